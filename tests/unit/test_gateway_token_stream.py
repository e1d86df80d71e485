"""The gateway's token stream logic without NATS: chunks reordered and deduplicated, stop strings cut
across pieces."""

from __future__ import annotations

from pdserve.gateway.stop_strings import StopStringMatcher
from pdserve.gateway.token_stream import ChunkReassembler
from pdserve.messages import FinishReason, TokenChunk, TokenLogprobs


def chunk(index: int, *ids: int, finish: FinishReason | None = None, error: str | None = None) -> TokenChunk:
    return TokenChunk(request_id="r", index=index, token_ids=ids, finish_reason=finish, error=error)


def test_out_of_order_chunks_come_out_in_order_once_the_gap_fills():
    r = ChunkReassembler()
    assert r.push(chunk(0, 10, 11)).token_ids == [10, 11]
    assert r.push(chunk(4, 14)).token_ids == [] and r.has_gap
    ready = r.push(chunk(2, 12, 13))
    assert ready.token_ids == [12, 13, 14] and not r.has_gap and not ready.done


def test_repeated_and_overlapping_chunks_are_dropped():
    r = ChunkReassembler()
    r.push(chunk(0, 1, 2, 3))
    assert r.push(chunk(0, 1, 2, 3)).token_ids == []
    assert r.push(chunk(1, 2, 3, 4, 5)).token_ids == [4, 5]
    assert r.next_index == 5 and not r.has_gap


def test_finish_waits_for_the_tokens_before_it():
    r = ChunkReassembler()
    assert not r.push(chunk(2, 7, finish=FinishReason.LENGTH)).done
    ready = r.push(chunk(0, 5, 6))
    assert ready == ([5, 6, 7], FinishReason.LENGTH, None, ()) and r.done
    assert r.push(chunk(3, 8)).token_ids == []


def test_error_ends_the_stream_at_once_even_behind_a_gap():
    r = ChunkReassembler()
    r.push(chunk(0, 1))
    r.push(chunk(5, 9))
    ready = r.push(chunk(0, error="decode: worker lost"))
    assert ready.error == "decode: worker lost" and ready.token_ids == [] and r.done and not r.has_gap


def test_stop_string_split_across_pieces_is_cut_before_it():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("42 </an") == ("42 ", False)
    assert m.feed("swer> trailing") == ("", True)


def test_text_that_only_looked_like_a_stop_string_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "o w"])
    assert m.feed("hello world") == ("hell", True)


def test_no_stop_strings_passes_text_through():
    assert StopStringMatcher([]).feed("anything") == ("anything", False)


def test_logprobs_stay_aligned_with_tokens_across_repeats_and_reordering():
    def lp(t: int) -> TokenLogprobs:
        return TokenLogprobs(token_id=t, logprob=-t / 10)

    def with_lp(index: int, *ids: int) -> TokenChunk:
        return TokenChunk(request_id="r", index=index, token_ids=ids, logprobs=tuple(lp(t) for t in ids))

    r = ChunkReassembler()
    assert r.push(with_lp(2, 7, 8)).logprobs == ()
    ready = r.push(with_lp(0, 5, 6, 7))  # overlaps the held chunk by one token
    assert ready.token_ids == [5, 6, 7, 8] and [e.token_id for e in ready.logprobs] == [5, 6, 7, 8]
