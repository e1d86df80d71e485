"""OpenAI request validation: every class of bad input becomes a 400/404 in OpenAI's error shape, and good
input becomes the prompt tokens and sampling the coordinator gets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.bus import RejectedError
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.gateway.errors import APIError, api_error_from_validation, from_rejection
from pdserve.gateway.prompt import check_model, prepare_chat, prepare_completion
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.messages import RejectCode

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}]}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


def error_of(cls: type, body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return api_error_from_validation(info.value.errors())


def assert_openai_error(err: APIError, status: int, param: str | None = None) -> dict[str, Any]:
    body = err.body()
    assert err.status == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hello"}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.str"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": -5}, "max_tokens"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "top_k": -2}, "top_k"),
    ({**CHAT, "n": 17}, "n"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "seed": 2**63}, "seed"),
    ({**CHAT, "stop": ["a\x00"]}, "stop"),
    ({**CHAT, "stop": ""}, "stop"),
    ({**CHAT, "stop": ["ok", 3]}, "stop.str"),
    ({**CHAT, "seed": 1.5}, "seed"),
    ({**CHAT, "stream": "maybe"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": True}}, None),
    ({**CHAT, "logprobs": True, "top_logprobs": 6}, None),
    ({**CHAT, "top_logprobs": 2}, None),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "presence_penalty": 0.5}, None),
    ({"messages": CHAT["messages"], "model": 7}, "model"),
])
def test_bad_chat_request_is_a_400_in_openai_shape(body, param):
    err = error_of(ChatCompletionRequest, body)
    error = assert_openai_error(err, 400)
    if param is not None:
        assert error["param"] == param, error
    assert "Value error," not in error["message"]


@pytest.mark.parametrize("body", [
    {"model": MODEL},
    {**COMPLETION, "prompt": ""},
    {**COMPLETION, "prompt": []},
    {**COMPLETION, "prompt": ["a", "b"]},
    {**COMPLETION, "prompt": [1, -3]},
    {**COMPLETION, "prompt": {"text": "hi"}},
    {**COMPLETION, "echo": True},
    {**COMPLETION, "logprobs": 6},
    {**COMPLETION, "best_of": 3},
    {**COMPLETION, "max_tokens": 0},
])
def test_bad_completion_request_is_a_400_in_openai_shape(body):
    assert_openai_error(error_of(CompletionRequest, body), 400)


def test_malformed_json_error_says_so():
    err = api_error_from_validation([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error",
                                      "ctx": {"error": "Expecting value"}}])
    error = assert_openai_error(err, 400)
    assert error["code"] == "json_invalid" and "Expecting value" in error["message"]


def test_unknown_model_is_a_404_model_not_found():
    with pytest.raises(APIError) as info:
        check_model("gpt-4o", MODEL)
    error = assert_openai_error(info.value, 404, param="model")
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    check_model(MODEL, MODEL)
    check_model(None, MODEL)


def test_good_requests_accept_openai_fields_the_gateway_ignores():
    req = ChatCompletionRequest.model_validate({
        **CHAT, "user": "u-1", "cache_salt": "s", "metadata": {"k": "v"}, "store": False,
        "stream": True, "stream_options": {"include_usage": True}, "stop": "\n",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
    })
    assert req.include_usage and req.stop_strings == ("\n",)
    assert req.template_messages()[1] == {"role": "user", "content": "a\nb"}
    assert CompletionRequest.model_validate({**COMPLETION, "prompt": [[5, 6, 7]]}).prompt == [5, 6, 7]
    assert CompletionRequest.model_validate({**COMPLETION, "prompt": ["x"]}).prompt == "x"
    assert not CompletionRequest.model_validate({**COMPLETION, "stream": True}).include_usage


def test_explicit_nulls_mean_the_defaults():
    req = ChatCompletionRequest.model_validate({**CHAT, "temperature": None, "top_p": None, "n": None,
                                                "stream": None, "presence_penalty": None})
    assert (req.temperature, req.top_p, req.n, req.stream, req.presence_penalty) == (1.0, 1.0, 1, False, 0.0)


def test_prompt_token_ids_outside_the_vocabulary_are_a_400(tokenizer):
    req = CompletionRequest.model_validate({**COMPLETION, "prompt": [1, tokenizer.vocab_size]})
    with pytest.raises(APIError) as info:
        prepare_completion(req, tokenizer, max_model_len=2048)
    assert "vocabulary" in assert_openai_error(info.value, 400, param="prompt")["message"]


def test_chat_prompt_is_the_templated_conversation_with_the_generation_prompt(tokenizer):
    req = ChatCompletionRequest.model_validate({**CHAT, "max_completion_tokens": 7, "max_tokens": 99,
                                                "temperature": 0, "top_k": 0, "seed": 3})
    prepared = prepare_chat(req, tokenizer, max_model_len=2048)
    text = tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    s = prepared.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.seed) == (7, 0.0, -1, 3)
    assert set(tokenizer.stop_token_ids) <= set(s.stop_token_ids)


def test_chat_without_max_tokens_may_fill_the_rest_of_the_context(tokenizer):
    prepared = prepare_chat(ChatCompletionRequest.model_validate(CHAT), tokenizer, max_model_len=512)
    assert len(prepared.prompt_token_ids) + prepared.sampling.max_tokens == 512


def test_completion_defaults_to_16_tokens_and_takes_token_ids_as_is(tokenizer):
    prepared = prepare_completion(CompletionRequest.model_validate({**COMPLETION, "prompt": [1, 2, 3]}),
                                  tokenizer, max_model_len=2048)
    assert prepared.prompt_token_ids == (1, 2, 3) and prepared.sampling.max_tokens == 16


def test_ignore_eos_keeps_only_the_requested_stop_token_ids(tokenizer):
    req = CompletionRequest.model_validate({**COMPLETION, "ignore_eos": True, "stop_token_ids": [42]})
    prepared = prepare_completion(req, tokenizer, max_model_len=2048)
    assert prepared.sampling.stop_token_ids == (42,) and prepared.sampling.ignore_eos


@pytest.mark.parametrize(("cls", "body", "param"), [
    (CompletionRequest, {**COMPLETION, "max_tokens": 60}, "prompt"),
    (ChatCompletionRequest, {**CHAT, "max_tokens": 60}, "messages"),
    (ChatCompletionRequest, {**CHAT, "max_completion_tokens": 60}, "max_completion_tokens"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "word " * 80}]}, "messages"),
])
def test_prompt_plus_max_tokens_over_the_context_is_a_400(tokenizer, cls, body, param):
    prepare = prepare_chat if cls is ChatCompletionRequest else prepare_completion
    with pytest.raises(APIError) as info:
        prepare(cls.model_validate(body), tokenizer, max_model_len=64)
    error = assert_openai_error(info.value, 400, param=param)
    assert error["code"] == "context_length_exceeded" and "64" in error["message"]


def test_chat_template_refusal_is_a_400(tokenizer):
    strict = copy.copy(tokenizer)
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(APIError) as info:
        prepare_chat(ChatCompletionRequest.model_validate(CHAT), strict, max_model_len=2048)
    assert "alternate" in assert_openai_error(info.value, 400, param="messages")["message"]


@pytest.mark.parametrize(("code", "status", "retry_after"), [
    (RejectCode.CAPACITY, 503, True),
    (RejectCode.NO_WORKERS, 503, True),
    (RejectCode.INVALID, 400, False),
    (RejectCode.TRANSFER_FAILED, 502, False),
    (RejectCode.INTERNAL, 500, False),
    (RejectCode.DUPLICATE, 500, False),
])
def test_coordinator_refusals_map_to_http_statuses(code, status, retry_after):
    err = from_rejection(RejectedError(code, "because"))
    assert "because" in assert_openai_error(err, status)["message"]
    assert ("Retry-After" in err.headers) is retry_after
