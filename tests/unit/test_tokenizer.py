"""The tokenizer and chat template built from SmolLM2's GGUF metadata equal HF's tokenizer loaded from the
same file; the incremental detokenizer streams exactly the text of a full decode, never a broken character."""

from __future__ import annotations

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.model_files import smollm2_gguf_path
from pdserve.engine.tokenizer import Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    " Hello  world\n\n",
    "What is the capital of France?",
    "12345 + 678 = 13023, 3.14159 and 1,000,000",
    "naïve café — 東京 🤖 emoji 👍🏽 ΑΒΓ привет مرحبا",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2\t# tab\r\n",
    "I'm sure you're right; we'll see what they'd say.",
    "   leading and trailing   ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "<repo_name>x<file_sep>y<|endoftext|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a prime > 10 🙂"},
    ],
    [{"role": "user", "content": "  spaces\nand lines  "}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def hf_tokenizer():
    path = smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.smollm2
@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_hfs_gguf_tokenizer(tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.smollm2
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_like_hf(
    tokenizer, hf_tokenizer, messages, add_generation_prompt: bool
) -> None:
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


@pytest.mark.smollm2
def test_special_ids_and_sizes_match_hf(tokenizer, hf_tokenizer) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        hf_tokenizer.bos_token_id,
        hf_tokenizer.eos_token_id,
    )


def test_chat_template_keeps_chatml_markers_as_single_special_ids(tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)
    im_start, im_end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert "<|im_start|>" not in tokenizer.decode(ids) and "Hi" in tokenizer.decode(ids)


def test_stop_token_ids_are_eos_and_end_of_turn(tokenizer) -> None:
    assert tokenizer.token_to_id("<|im_end|>") in tokenizer.stop_token_ids
    assert tokenizer.stop_token_ids[0] == tokenizer.eos_token_id
    assert len(set(tokenizer.stop_token_ids)) == len(tokenizer.stop_token_ids)


def test_tiny_and_smollm2_share_one_tokenizer() -> None:
    assert load_tokenizer("tiny").encode("Paris") == load_tokenizer("smollm2").encode("Paris")


def test_unknown_model_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        load_tokenizer("gpt-5")


# ---------------------------------------------------------------- incremental detokenization


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    return [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["Ünïcödé ✓ 🤖🤖 done."])
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer, text: str, step: int) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Prompt: say something"))
    deltas = stream(detok, ids, step)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)


def test_a_character_split_across_tokens_is_held_back_until_complete(tokenizer) -> None:
    ids = tokenizer.encode("ok 🤖 go")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the emoji really is split across byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids, 1)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some step emitted nothing while the character was incomplete
    assert any("🤖" in d for d in deltas)


def test_special_tokens_are_not_streamed(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.add(tokenizer.encode("Paris.<|im_end|>"))
    assert text == "Paris."
