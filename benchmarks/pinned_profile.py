"""`pdserve profile` of SmolLM2 pinned to core 0 (the core the first worker pool is pinned to: the
prefill pool, or the first unified worker), on a grid small enough for a benchmark to take one before and
after it measures (~30 s on this machine): the engine profile `benchmarks/sim_validation.py` calibrates
the simulator with and `benchmarks/advise_workloads.py` gives `pdserve advise --profile`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.sim.profile import Profile

PROFILE_ARGS = [
    "--prompt-lengths", "8", "32", "64", "128", "256",
    "--chunk-sizes", "512", "64",
    "--batches", "1", "2", "4", "8", "16",
    "--contexts", "16", "64", "160",
    "--decode-steps", "5",
    "--reps", "2",
    "--transports", "ucxx", "tcp",
    "--families", "smollm2",
    "--disable-tqdm",
]  # fmt: skip


def profile_here(out: Path, model: str = "smollm2") -> Profile:
    """Run `pdserve profile` on core 0 into `out` and read it back. Raises CalledProcessError when the
    profile fails, TimeoutExpired after 30 minutes."""
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "pdserve.cli.main", "profile", "--model", model]
    subprocess.run([*cmd, "--out", str(out), *PROFILE_ARGS], check=True, timeout=1800)
    return Profile.read(out)
