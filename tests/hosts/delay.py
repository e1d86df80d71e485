"""Hold every packet queued to NFQUEUE `--queue` for `--delay-ms`, then accept it: a fixed one-way delay
where the kernel has no netem qdisc (`tests/hosts/netns.py: Host.set_delay_ms`). Run inside the host's
network namespace (queues are per namespace); prints `bound` once the queue is bound, so packets queued
after that line are never dropped for want of a listener.

Packets keep their order: each waits the same delay, and they are released in arrival order. Only the
packet metadata comes to user space (COPY_META), and GSO packets are queued whole (one verdict per
super-packet, not per segment), so the delayer costs little CPU at the rates a test stack sends.
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import threading
import time

import fnfqueue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--queue", type=int, default=0)
    args = parser.parse_args()
    delay_s = args.delay_ms / 1000

    conn = fnfqueue.Connection()
    queue = conn.bind(args.queue)
    queue.set_mode(fnfqueue.MAX_PAYLOAD, fnfqueue.COPY_META)
    queue.gso = True
    queue.set_maxlen(65536)
    held: collections.deque = collections.deque()
    ready = threading.Condition()
    stopping = threading.Event()

    def release() -> None:
        while not stopping.is_set():
            with ready:
                while not held and not stopping.is_set():
                    ready.wait(0.5)
                if stopping.is_set():
                    return
                due, packet = held[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with ready:
                held.popleft()
            packet.accept()

    threading.Thread(target=release, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: (stopping.set(), conn.close(), sys.exit(0)))
    print("bound", flush=True)
    wall_to_monotonic = time.monotonic() - time.time()
    for packet in conn:
        try:  # when the kernel stamped it: its delay counts from there, not from our wake-up
            queued = packet.time.timestamp() + wall_to_monotonic
        except (fnfqueue.NoSuchAttributeException, KeyError):
            queued = time.monotonic()
        with ready:
            held.append((queued + delay_s, packet))
            ready.notify()


if __name__ == "__main__":
    main()
