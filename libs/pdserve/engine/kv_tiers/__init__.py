"""Tiers of KV cache below a worker's paged pool (issue 16): host-memory offload, disk, a shared store.

`tier.KVTier` is the protocol every tier implements; the engine (`engine/llm_engine.py`) writes blocks down
to them and copies prefix hits back from them.
"""
