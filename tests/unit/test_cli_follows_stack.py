"""`pdserve bench serve` targets the running stack's gateway (var/run/stack.json), whatever its port."""

from __future__ import annotations

import argparse

from pdserve.cli.bench import DEFAULT_BASE_URL, _database_url, base_url
from pdserve.stack_state import StackState, write_state


def _args(var_dir, **kw) -> argparse.Namespace:
    return argparse.Namespace(**{"base_url": None, "database_url": None, "no_breakdown": False,
                                 "var_dir": str(var_dir), **kw})


def test_bench_serve_follows_the_running_stacks_port(tmp_path):
    assert base_url(_args(tmp_path)) == DEFAULT_BASE_URL  # no stack: the default
    write_state(tmp_path, StackState(supervisor_pid=1, supervisor_create_time=1.0, mode="disaggregated",
                                     model="tiny", var_dir=str(tmp_path), gateway_url="http://127.0.0.1:8011",
                                     database_url="postgresql+asyncpg://postgres@127.0.0.1:5999/pdserve"))
    args = _args(tmp_path)
    assert base_url(args) == "http://127.0.0.1:8011"
    assert _database_url(args, base_url(args)) == "postgresql+asyncpg://postgres@127.0.0.1:5999/pdserve"
    explicit = _args(tmp_path, base_url="http://10.0.0.5:9000/")
    assert base_url(explicit) == "http://10.0.0.5:9000"
    assert _database_url(explicit, base_url(explicit)) is None  # another gateway: not this stack's store
