"""Which of a worker's threads run torch's intra-op (OpenMP) parallelism: one thread, the engine loop's step
thread, on every core the worker owns; every other thread on one.

torch's CPU ops parallelize through OpenMP, and libgomp gives each thread that opens a parallel region a
team of its own. Once a process holds more team threads than the cores it may run on, libgomp stops
spinning at barriers and sleeps in the kernel at every one, and a forward opens hundreds of parallel
regions. `benchmarks/step_thread.py` measures it (docs/benchmarks/step_thread.md; SmolLM2 fp32, torch
2.13, this 2-core host): against one thread, steps on one step thread with two threads ran a 128-token
prefill 1.61× and an 8-sequence decode step 1.42× as fast; the same two threads on pool threads taken in
turn, after the main thread had a team, 1.17× and 0.92× (slower than one thread). Served (one unified
worker, both cores, random 128-token prompts, 64 output tokens), moving every step onto one thread took
the prefill's forward from 116–143 ms to 85 ms, and made two threads pay off for decode as well: TPOT
p50 16 ms at concurrency 1 and 30 ms at 8, against 21 and 40 ms with decode steps kept on one thread.

So a worker process runs `one_thread()` first (its main thread, and every thread it starts that runs
torch ops, as their executor's initializer), and its engine loop's step thread sets the worker's own
count (`WorkerSettings.torch_threads`). A thread takes the count it runs with from the last
`torch.set_num_threads` of any thread when it first runs a torch op, which is why the others set theirs
themselves instead of inheriting it.
"""

from __future__ import annotations

import torch


def one_thread() -> None:
    """Run the calling thread's torch ops on one thread (no OpenMP team of its own)."""
    torch.set_num_threads(1)
