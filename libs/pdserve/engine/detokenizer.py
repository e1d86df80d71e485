"""Incremental detokenization: text deltas as generated token ids arrive, never a broken UTF-8 character."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.tokenizer import Tokenizer

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded as left context for the first delta
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas (vLLM's prefix/read-offset method).

    Each `add` decodes a short window, `ids[prefix_offset:]`, and returns what it adds beyond the text
    of `ids[prefix_offset:read_offset]` (already emitted). Decoding a window rather than single tokens keeps
    tokenizers whose pieces depend on their left neighbour (leading-space rules) right, and costs O(window)
    per call instead of re-decoding the whole output. When the window ends in U+FFFD the last token ended
    inside a multi-byte UTF-8 character: nothing is emitted until a later token completes it. Special tokens
    are skipped. `text` holds everything emitted so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids or ())
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated `token_ids`; return the text they complete ("" while a character is split)."""
        self._ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
