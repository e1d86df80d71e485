"""LLMEngine on the seeded tiny Llama against one-sequence greedy decoding (`tests.oracle.greedy`, itself
checked against HF transformers): every prompt length around each multiple of the block size, pools around the
capacity a request needs, chunking, batching, preemption, prefix-cache hits and salts — with no block
leaked."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import CannotFit, EngineConfig, LLMEngine
from pdserve.engine.loader import LoadedModel, load_model
from pdserve.engine.model import LlamaModel
from pdserve.engine.sequence import Sequence
from pdserve.kernels.kv_pack import token_slots, unpack_kv
from pdserve.messages import SamplingParams
from tests import oracle

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    return load_model("tiny", tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def model(tiny) -> LlamaModel:
    return LlamaModel(tiny.config, tiny.weights)


@pytest.fixture(scope="module")
def tokens(tiny) -> list[int]:
    return torch.randint(
        0, tiny.config.vocab_size, (200,), generator=torch.Generator().manual_seed(11)
    ).tolist()


@pytest.fixture(scope="module")
def expected(model, tokens):
    cache: dict[tuple[int, int], list[int]] = {}

    def greedy(offset: int, length: int, max_tokens: int = GREEDY.max_tokens) -> list[int]:
        key = (offset, length, max_tokens)
        if key not in cache:
            cache[key] = oracle.greedy(model, tokens[offset : offset + length], max_tokens)
        return cache[key]

    return greedy


def run(engine: LLMEngine, seqs: list[Sequence], max_steps: int = 10_000) -> None:
    for s in seqs:
        engine.add_request(s)
    for _ in range(max_steps):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("engine did not finish")


def engine_of(model, num_blocks: int, budget: int = 512, **kw) -> LLMEngine:
    return LLMEngine(
        model, EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=budget, **kw)
    )


BOUNDARY_LENGTHS = sorted({n for m in (1, 2, 3) for n in (m * BS - 1, m * BS, m * BS + 1)} | {1, 2})


@pytest.mark.parametrize("length", BOUNDARY_LENGTHS)
def test_prompts_around_every_block_boundary_decode_the_greedy_tokens_and_free_every_block(
    model, tokens, expected, length
):
    engine = engine_of(model, num_blocks=8, budget=7)  # chunks cross block edges at odd places
    free0 = engine.block_manager.num_free_blocks
    s = Sequence("a", tokens[:length], GREEDY)
    run(engine, [s])
    assert s.output_token_ids == expected(0, length)
    assert engine.block_manager.num_free_blocks == free0
    again = Sequence("b", tokens[:length], GREEDY)
    run(engine, [again])
    assert again.num_cached_tokens == (length - 1) // BS * BS
    assert again.output_token_ids == expected(0, length)
    assert engine.block_manager.num_free_blocks == free0


@pytest.mark.parametrize("total_tokens", [BS * 3 - 1, BS * 3, BS * 3 + 1])
@pytest.mark.parametrize("num_blocks", [2, 3, 4])
def test_pools_around_a_requests_capacity_fit_exactly_or_refuse_clearly(
    model, tokens, expected, total_tokens, num_blocks
):
    engine = engine_of(model, num_blocks=num_blocks, budget=16)
    max_tokens = 6
    s = Sequence(
        "a",
        tokens[: total_tokens - max_tokens],
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    if -(-total_tokens // BS) > num_blocks:
        with pytest.raises(CannotFit, match="blocks"):
            engine.add_request(s)
        assert not engine.has_work
    else:
        run(engine, [s])
        assert s.output_token_ids == expected(0, total_tokens - max_tokens, max_tokens)
    assert engine.block_manager.num_free_blocks == num_blocks


@pytest.mark.parametrize("num_blocks, budget", [(64, 512), (64, 5), (9, 16), (6, 8)])
def test_batches_chunks_and_preemption_give_each_sequence_its_own_greedy_tokens(
    model, tokens, expected, num_blocks, budget
):
    engine = engine_of(model, num_blocks=num_blocks, budget=budget)
    shapes = [(0, 17), (3, 40), (50, 1), (60, 33), (9, 16), (100, 31)]
    seqs = [Sequence(f"r{i}", tokens[o : o + n], GREEDY) for i, (o, n) in enumerate(shapes)]
    run(engine, seqs)
    for s, (o, n) in zip(seqs, shapes, strict=True):
        assert s.output_token_ids == expected(o, n), s.request_id
    assert engine.block_manager.num_free_blocks == num_blocks
    if num_blocks == 6:
        assert engine.stats.num_preemptions > 0  # the small pool really forced recompute


def test_the_same_request_twice_computes_only_its_last_prompt_token(model, tokens, expected):
    engine = engine_of(model, num_blocks=16)
    prompt = tokens[: 2 * BS + 1]
    run(engine, [Sequence("first", prompt, GREEDY)])
    before = engine.stats.num_prompt_tokens_computed
    second = Sequence("second", prompt, GREEDY)
    run(engine, [second])
    assert second.num_cached_tokens == 2 * BS
    assert engine.stats.num_prompt_tokens_computed - before == 1
    assert second.output_token_ids == expected(0, 2 * BS + 1)


def test_requests_with_different_cache_salts_share_no_block(model, tokens):
    engine = engine_of(model, num_blocks=16)
    prompt = tokens[: 2 * BS + 1]
    run(engine, [Sequence("a", prompt, GREEDY, cache_salt="tenant-a")])
    other = Sequence("b", prompt, GREEDY, cache_salt="tenant-b")
    unsalted = Sequence("c", prompt, GREEDY)
    run(engine, [other, unsalted])
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    same = Sequence("d", prompt, GREEDY, cache_salt="tenant-a")
    run(engine, [same])
    assert same.num_cached_tokens == 2 * BS


def test_stop_tokens_end_a_sequence_unless_ignore_eos_and_max_tokens_counts_from_the_resume_index(
    model, tokens, expected
):
    # a prompt whose greedy output has a token that is new after the first one (the tiny model repeats a lot)
    offset, k = next(
        (o, i)
        for o in range(0, 150, 10)
        for i in range(1, 6)
        if expected(o, 10, 6)[i] not in expected(o, 10, 6)[:i]
    )
    free = expected(offset, 10, 6)
    prompt = tokens[offset : offset + 10]
    engine = engine_of(model, num_blocks=8)
    stop = Sequence("stop", prompt, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(free[k],)))
    resumed = Sequence("resumed", prompt, GREEDY, output_start_index=4)
    run(engine, [stop, resumed])
    assert stop.output_token_ids == free[:k]  # the stop token itself is not output
    assert resumed.output_token_ids == free[:2]  # 6 - 4 tokens left
    assert engine.block_manager.num_free_blocks == 8


def test_a_reserved_sequence_filled_from_elsewhere_decodes_like_one_prefilled_here(model, tokens, expected):
    """The decode role: blocks reserved, KV landed from another engine (here: copied), then admitted."""
    prompt = tokens[:37]
    source = engine_of(model, num_blocks=8)
    prefill = Sequence("p", prompt, GREEDY)
    prefill.stop_after_prefill = True
    rows: dict[int, list[torch.Tensor]] = {}
    prefill.kv_sink = lambda layer, start, kv: rows.setdefault(layer, []).append(kv)
    source.add_request(prefill)
    (out,) = [o for o in source.step() if o.prefill_done]
    decode = engine_of(model, num_blocks=8)
    seq = Sequence("d", prompt, GREEDY)
    decode.reserve(seq, GREEDY.max_tokens)
    slots = token_slots(seq.block_table, 0, len(prompt), BS)
    for layer, chunks in rows.items():
        unpack_kv(decode.runner.kv_cache[layer], slots, torch.cat(chunks))
    decode.mark_computed(seq, len(prompt))
    assert decode.admit(seq, out.sampled_token_id) is None
    while decode.has_work:
        decode.step()
    assert seq.output_token_ids == expected(0, 37)
    assert decode.block_manager.num_free_blocks == 8
    assert seq.status.value == "finished" and out.finish_reason is None


def test_a_locally_prefilled_sequence_parks_then_decodes_once_admitted(model, tokens, expected):
    """The unified role: reserve, prefill in the reserved blocks, park, admit the first token, decode."""
    engine = engine_of(model, num_blocks=8)
    seq = Sequence("u", tokens[:33])
    engine.reserve(seq, GREEDY.max_tokens)
    seq.set_sampling(GREEDY)
    engine.prefill_held(seq)
    (out,) = engine.step()
    assert out.prefill_done and seq.status.value == "parked" and not engine.has_work
    assert engine.admit(seq, out.sampled_token_id) is None
    while engine.has_work:
        engine.step()
    assert seq.output_token_ids == expected(0, 33)
    assert engine.block_manager.num_free_blocks == 8


def test_requests_reserved_added_and_freed_while_a_forward_runs_change_only_the_next_step(
    model, tokens, expected
):
    """A worker makes engine calls beside `run_step` (the lock is released for the forward): a sequence
    added mid-forward joins the next step, a reservation made mid-forward holds its blocks, and one freed
    mid-forward keeps its blocks until `finish_step`, which skips it; in the end every block is free and
    every survivor's tokens are greedy."""
    engine = engine_of(model, num_blocks=12)
    running, doomed = Sequence("r", tokens[:20], GREEDY), Sequence("x", tokens[30:50], GREEDY)
    engine.add_request(running)
    engine.add_request(doomed)
    plan = engine.begin_step()
    assert plan is not None and [s.request_id for s, _ in plan.batch] == ["r", "x"]
    logits = engine.run_step(plan)  # "meanwhile", from the handlers' side:
    late = Sequence("l", tokens[60:77], GREEDY)
    engine.add_request(late)
    reserved = Sequence("v", tokens[80:97])
    engine.reserve(reserved, GREEDY.max_tokens)
    free_before = engine.block_manager.num_free_blocks
    engine.free(doomed)
    assert engine.block_manager.num_free_blocks == free_before  # the forward still writes into them
    outputs = engine.finish_step(plan, logits)
    assert [o.seq.request_id for o in outputs] == ["r"]
    assert engine.block_manager.num_free_blocks == free_before + 2
    assert doomed.status.value == "finished" and not doomed.output_token_ids
    engine.free(reserved)
    run(engine, [])
    assert running.output_token_ids == expected(0, 20) and late.output_token_ids == expected(60, 17)
    assert engine.block_manager.num_free_blocks == 12
