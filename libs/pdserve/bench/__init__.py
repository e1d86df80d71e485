"""Serving benchmarks: the load generator (`pdserve bench serve`) and the colocated-vs-disaggregated
sweep (`pdserve bench compare`). Metric definitions follow `vllm bench serve` (vllm/benchmarks/serve.py)."""
