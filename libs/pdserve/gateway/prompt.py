"""From a validated OpenAI request to what the coordinator needs: prompt token ids, sampling, stop strings.

The chat template and the tokenizer are the model's own (`pdserve.engine.tokenizer.load_tokenizer`). The
context check is vLLM's: prompt tokens + max_tokens must fit in `max_model_len`, else 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.gateway.errors import APIError, context_length_exceeded, invalid_request, model_not_found
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.messages import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy /v1/completions default
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows to inf.
SAMPLING_EPS = 1e-5
# No token of the served vocabularies decodes to more characters than this (SmolLM2's longest: 81), so a
# text longer than max_model_len × this many characters cannot fit and is refused before tokenizing it
# (tokenizing megabytes would hold the gateway's event loop for seconds).
MAX_CHARS_PER_TOKEN = 128


class Tokenizer(Protocol):
    """What the gateway uses of `pdserve.engine` tokenizers."""

    @property
    def stop_token_ids(self) -> Sequence[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class PreparedRequest:
    """`prompt_token_ids`: the tokens to prefill; `sampling`: what decode samples with (its
    `stop_token_ids` include the tokenizer's EOS/stop ids unless `ignore_eos`); `stop`: stop strings the
    gateway applies to the detokenized text."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]


def check_model(requested: str | None, served: str) -> None:
    """Raise 404 `model_not_found` unless the request names the served model (or none)."""
    if requested is not None and requested != served:
        raise model_not_found(requested)


def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> PreparedRequest:
    """Raises `APIError` 400 when the prompt does not fit the context with `max_tokens`."""
    prompt = req.prompt
    if isinstance(prompt, str):
        _check_length(prompt, max_model_len, "prompt")
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise invalid_request("prompt encodes to no tokens", param="prompt")
    if max(ids) >= tokenizer.vocab_size:
        raise invalid_request(f"prompt token id {max(ids)} is outside the vocabulary "
                              f"(size {tokenizer.vocab_size})", param="prompt")
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    return _prepared(req, tokenizer, ids, max_tokens, max_model_len, param="prompt")


def prepare_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> PreparedRequest:
    """Applies the chat template with the generation prompt. Raises `APIError` 400 when the template
    refuses the messages or the conversation does not fit the context."""
    messages = req.template_messages()
    _check_length("".join(m["content"] for m in messages), max_model_len, "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # jinja templates reject bad role orders with raise_exception(...)
        raise invalid_request(f"The chat template rejected the messages: {e}", param="messages") from e
    ids = tokenizer.encode(text)
    requested = req.requested_max_tokens
    # vLLM's default: the completion may use whatever context the prompt leaves.
    max_tokens = requested if requested is not None else max(max_model_len - len(ids), 1)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "messages"
    return _prepared(req, tokenizer, ids, max_tokens, max_model_len, param=param)


def _check_length(text: str, max_model_len: int, param: str) -> None:
    """Raise `APIError` 400 `context_length_exceeded` for a text too long to fit whatever its tokens."""
    if len(text) > max_model_len * MAX_CHARS_PER_TOKEN:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens; the {param} has {len(text)} "
            f"characters, more than any {max_model_len} tokens can hold.",
            param=param, code="context_length_exceeded")


def _prepared(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer, ids: list[int],
              max_tokens: int, max_model_len: int, param: str) -> PreparedRequest:
    if len(ids) + max_tokens > max_model_len:
        raise context_length_exceeded(max_model_len, len(ids), max_tokens, param)
    stop_ids = tuple(req.stop_token_ids or ())
    if not req.ignore_eos:
        stop_ids = tuple(dict.fromkeys((*tokenizer.stop_token_ids, *stop_ids)))
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature if req.temperature >= SAMPLING_EPS else 0.0,
            top_p=req.top_p,
            top_k=-1 if req.top_k == 0 else req.top_k,
            seed=req.seed,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            logprobs=req.num_logprobs,
        )
    except ValueError as e:
        raise APIError(400, f"Invalid sampling parameters: {e}") from e
    return PreparedRequest(tuple(ids), sampling, req.stop_strings)
