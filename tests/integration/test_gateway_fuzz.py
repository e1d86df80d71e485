"""schemathesis against the gateway's OpenAPI (every endpoint): no generated input, valid or not, gets a
5xx. The gateway runs on a real uvicorn server over real NATS and Postgres, with the scripted coordinator
(tests/integration/gateway_harness.py) answering every accepted request. CI runs a small example count;
the README has the full command (≥ 1,000 cases, against a real stack)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.integration.gateway_harness import answer_ids, in_order

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
MAX_EXAMPLES = 15  # per operation and phase; the README's command runs far more


async def test_fuzzed_requests_never_get_a_server_error(server_url, coord, tokenizer, tmp_path):
    coord.script = in_order(answer_ids(tokenizer))
    proc = await asyncio.create_subprocess_exec(
        str(SCHEMATHESIS), "run", f"{server_url}/openapi.json", "--checks", "not_a_server_error",
        "--max-examples", str(MAX_EXAMPLES), "--seed", "18", "--workers", "1", "--no-color",
        "--report", "junit", "--report-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path)
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    assert "No issues found" in text or "passed" in text, text[-3000:]
