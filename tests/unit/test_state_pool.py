"""The hybrid's state pool: a slot per sequence taken at admission and given back on finish, abort and
preemption, never more live states than slots (sequences wait instead), checkpoints evicted for live
sequences and never the reverse, and the state handoff a disaggregated deployment needs (the whole state
after the last prefill chunk, installed into a reserved sequence) giving the tokens of one engine alone."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_events import CheckpointRemoved, CheckpointStored
from pdserve.engine.llm_engine import EngineConfig, LLMEngine, NoFreeStateSlots
from pdserve.engine.loader import build_model
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.state_pool import StatePool
from pdserve.kernels.kv_pack import token_slots, unpack_kv
from pdserve.messages import SamplingParams
from tests import oracle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(kimi):
    return build_model(kimi)


@pytest.fixture(scope="module")
def tokens(kimi) -> list[int]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(0, kimi.config.vocab_size, (200,), generator=generator).tolist()


SHAPES = [(0, 17), (3, 40), (50, 1), (60, 33), (9, 16), (100, 31)]


@pytest.fixture(scope="module")
def expected(model, tokens) -> list[list[int]]:
    return [oracle.greedy(model, tokens[o : o + n], GREEDY.max_tokens) for o, n in SHAPES]


def engine_of(model, num_blocks: int = 64, budget: int = 512, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=budget,
                                         **kw))


def requests(tokens) -> list[Sequence]:
    return [Sequence(f"r{i}", tokens[o : o + n], GREEDY) for i, (o, n) in enumerate(SHAPES)]


def holders(engine: LLMEngine, seqs: list[Sequence]) -> set[int]:
    return {s.state_slot for s in seqs if s.state_slot is not None}


def test_a_slot_is_taken_at_admission_and_given_back_on_finish_and_abort(model, tokens):
    engine = engine_of(model, num_state_slots=8, checkpoint_interval=0)
    pool = engine.state_pool
    seqs = requests(tokens)[:3]
    for s in seqs:
        engine.add_request(s)
    assert pool.num_live == 0  # queued, not admitted
    engine.step()
    assert pool.num_live == 3 and holders(engine, seqs) == set(pool.live)
    engine.free(seqs[1])  # abort
    assert pool.num_live == 2 and seqs[1].state_slot is None
    engine.free(seqs[1])  # idempotent
    while engine.has_work:
        engine.step()
    assert pool.num_live == 0 and pool.num_free_slots == 8 and all(s.state_slot is None for s in seqs)


@pytest.mark.parametrize("num_slots", [1, 2, 4])
def test_never_more_live_states_than_slots_and_every_sequence_still_gets_its_tokens(
    model, tokens, expected, num_slots
):
    engine = engine_of(model, num_state_slots=num_slots, budget=24)
    seqs = requests(tokens)
    for s in seqs:
        engine.add_request(s)
    most = 0
    while engine.has_work:
        engine.step()
        live = [s for s in seqs if s.state_slot is not None]
        assert len(live) == engine.state_pool.num_live <= num_slots
        assert len({s.state_slot for s in live}) == len(live)  # no slot shared
        most = max(most, len(live))
    assert most == num_slots
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.state_pool.num_live == 0


def test_preemption_gives_the_slot_back_and_the_recompute_gets_the_same_tokens(model, tokens, expected):
    engine = engine_of(model, num_blocks=6, budget=8, num_state_slots=6)
    seqs = requests(tokens)
    for s in seqs:
        engine.add_request(s)
    while engine.has_work:
        engine.step()
        for s in seqs:  # a sequence holds a slot exactly while it holds blocks (running)
            assert (s.state_slot is not None) == bool(s.block_table), s
    assert engine.stats.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.state_pool.num_live == 0 and engine.block_manager.num_free_blocks == 6


def test_checkpoints_yield_to_live_sequences_and_never_take_a_live_slot(model, tokens):
    engine = engine_of(model, num_state_slots=2, checkpoint_interval=BS)
    pool = engine.state_pool
    engine.generate([tokens[:40]], GREEDY)  # one forward crosses 16 and 32, one slot free: the latest kept
    assert [(type(e), getattr(e, "num_tokens", None)) for e in pool.take_events()] == [(CheckpointStored, 32)]
    chunked = engine_of(model, num_state_slots=2, checkpoint_interval=BS, budget=BS)
    chunked.generate([tokens[:40]], GREEDY)  # 16 saved, then evicted for 32
    events = chunked.state_pool.take_events()
    assert [type(e) for e in events] == [CheckpointStored, CheckpointRemoved, CheckpointStored]
    assert len(pool.checkpoints) == 1 and pool.num_live == 0
    a, b = Sequence("a", tokens[100:140], GREEDY), Sequence("b", tokens[150:190], GREEDY)
    engine.add_request(a)
    engine.add_request(b)
    engine.step()  # both live: the checkpoint was evicted for the second; none could be saved
    assert pool.num_live == 2 and not pool.checkpoints
    assert CheckpointRemoved in [type(e) for e in pool.take_events()]
    while engine.has_work:
        engine.step()
    assert pool.num_live == 0


def test_a_sequence_adopts_the_checkpoint_it_resumes_from_when_that_is_the_only_slot_left(model, tokens):
    engine = engine_of(model, num_state_slots=2, checkpoint_interval=2 * BS)
    prefix = tokens[:40]
    engine.generate([prefix], GREEDY)  # the state at 32 checkpointed
    busy = Sequence("busy", tokens[100:110], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    hit = Sequence("hit", prefix[:36] + tokens[150:160], GREEDY)
    engine.add_request(busy)  # takes the free slot; the checkpoint's is the only one left for `hit`
    engine.add_request(hit)
    engine.step()
    assert hit.num_checkpoint_tokens == 32 and hit.num_cached_tokens == 32
    while engine.has_work:
        engine.step()
    assert hit.output_token_ids == oracle.greedy(model, hit.token_ids[: hit.num_prompt_tokens], 8)


def test_the_pool_refuses_clearly_when_every_slot_is_live(model):
    pool = StatePool(model.cache_spec().state, 2, block_size=BS)
    seqs = [Sequence(f"s{i}", [1, 2, 3]) for i in range(3)]
    pool.allocate(seqs[0])
    pool.allocate(seqs[1])
    with pytest.raises(NoFreeStateSlots):
        pool.allocate(seqs[2])
    assert seqs[2].state_slot is None and pool.num_live == 2
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate(seqs[0])
    pool.free(seqs[0])
    pool.allocate(seqs[2])
    assert pool.num_live == 2


def test_the_state_after_prefill_installed_into_a_reserved_sequence_decodes_like_one_engine(
    model, tokens, expected
):
    """The disaggregated handoff: the prefill engine streams the MLA KV layer by layer and hands the whole
    KDA state with its prefill_done output; the decode engine reserves (state arriving), lands both,
    and admits."""
    o, n = SHAPES[3]
    prompt = tokens[o : o + n]
    source = engine_of(model, budget=13)  # chunked: the state is complete only after the last chunk
    prefill = Sequence("p", prompt, GREEDY)
    prefill.stop_after_prefill = True
    prefill.free_after_prefill = True
    rows: dict[int, list[torch.Tensor]] = {}
    prefill.kv_sink = lambda layer, start, kv: rows.setdefault(layer, []).append(kv)
    source.add_request(prefill)
    done = []
    while source.has_work:
        done += [out for out in source.step() if out.prefill_done]
    (out,) = done
    assert out.state is not None and source.state_pool.num_live == 0  # read before the slot was freed
    cfg = model.config
    assert out.state["recurrent"].shape == (cfg.num_kda_layers, cfg.linear_num_heads, cfg.linear_head_dim,
                                            cfg.linear_head_dim)
    decode = engine_of(model)
    seq = Sequence("d", prompt, GREEDY)
    decode.reserve(seq, GREEDY.max_tokens, state_arrives=True)
    assert seq.status is SequenceStatus.RESERVED and seq.state_slot is not None
    slots = token_slots(seq.block_table, 0, len(prompt), BS)
    for layer, chunks in rows.items():
        unpack_kv(decode.runner.kv_cache[layer], slots, torch.cat(chunks))
    with pytest.raises(ValueError, match="recurrent"):
        decode.install_state(seq, {**out.state, "recurrent": out.state["recurrent"][1:]})
    decode.install_state(seq, out.state)
    assert all(torch.equal(decode.read_state(seq)[k], v) for k, v in out.state.items())
    decode.mark_computed(seq, len(prompt))
    assert decode.admit(seq, out.sampled_token_id) is None
    while decode.has_work:
        decode.step()
    assert seq.output_token_ids == expected[3]
    assert decode.state_pool.num_live == 0


def test_a_wrong_state_gives_other_tokens(model, tokens, expected):
    """The reason the state must arrive exact: the same KV with a zeroed state decodes differently."""
    o, n = SHAPES[3]
    prompt = tokens[o : o + n]
    engine = engine_of(model)
    seq = Sequence("u", prompt)
    engine.reserve(seq, GREEDY.max_tokens)
    seq.set_sampling(GREEDY)
    engine.prefill_held(seq)
    (out,) = engine.step()
    assert out.prefill_done and seq.status is SequenceStatus.PARKED
    state = engine.read_state(seq)
    engine.install_state(seq, {k: torch.zeros_like(v) for k, v in state.items()})
    engine.admit(seq, out.sampled_token_id)
    while engine.has_work:
        engine.step()
    assert seq.output_token_ids != expected[3]
