"""`pdserve profile` on the tiny model (real engine, real measurements, a small grid) and `pdserve sim` on
the profile it wrote: the file round-trips, the fit is sane, the simulation and its searches run."""

from __future__ import annotations

import json

import pytest

from pdserve.cli.main import main
from pdserve.sim.profile import Profile

pytestmark = pytest.mark.slow  # a real profile of the tiny model: ~40-90 s on 2 loaded cores


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    rc = main(
        [
            "profile",
            "--model",
            "tiny",
            "--families",
            "tiny",
            "kimi-tiny",
            "--prompt-lengths",
            "8",
            "32",
            "64",
            "--chunk-sizes",
            "32",
            "--batches",
            "1",
            "4",
            "--contexts",
            "16",
            "64",
            "--decode-steps",
            "3",
            "--reps",
            "1",
            "--transports",
            "--out",
            str(path),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    return path


def test_profile_measures_fits_and_scales(profile_path):
    prof = Profile.read(profile_path)
    assert len(prof.prefill) == 3 and len(prof.decode) == 4
    assert all(s.seconds > 0 for s in prof.prefill + prof.decode)
    families = {f.family: f for f in prof.families}
    assert families["llama"].kv_bytes_per_token == prof.model.kv_bytes_per_token
    assert families["llama"].state_bytes_per_request == 0
    assert families["kimi_linear"].state_bytes_per_request > 0
    assert 0 < prof.efficiency.compute <= 1 and 0 < prof.efficiency.memory <= 1
    names = {h.name for h in prof.hardware}
    assert "h100-sxm-tp8-llama-3-70b-bf16" in names and "l40s-tp1-llama-3-8b-bf16" in names
    assert "l40s-tp8-llama-3-70b-bf16" not in names  # no such entry asked for


def test_sim_runs_both_modes_and_writes_json_and_png(profile_path, tmp_path):
    rc = main(
        [
            "sim",
            "--profile",
            str(profile_path),
            "--mode",
            "both",
            "--num-prompts",
            "40",
            "--input-len",
            "64",
            "--output-len",
            "8",
            "--request-rate",
            "4",
            "--link-gbps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = json.loads((tmp_path / "sim.json").read_text())
    assert set(out["modes"]) == {"colocated", "disaggregated"}
    assert all(m["completed"] == 40 for m in out["modes"].values())
    assert (tmp_path / "sim.png").stat().st_size > 0


def test_sim_searches_rate_and_split_on_a_published_accelerator(profile_path, tmp_path):
    common = [
        "sim",
        "--profile",
        str(profile_path),
        "--hardware",
        "h100-sxm-tp1-llama-3-8b-bf16",
        "--mode",
        "disaggregated",
        "--num-prompts",
        "200",
        "--input-len",
        "512",
        "--output-len",
        "32",
        "--link",
        "InfiniBand NDR",
        "--goodput",
        "ttft:500",
        "tpot:50",
    ]
    assert main([*common, "--search", "rate", "--out", str(tmp_path), "--label", "rate"]) == 0
    rate = json.loads((tmp_path / "rate.json").read_text())["modes"]["disaggregated"]
    assert rate["goodput_rate"] > 0 and rate["probes"]
    assert (
        main(
            [
                *common,
                "--search",
                "split",
                "--request-rate",
                "40",
                "--max-replicas",
                "6",
                "--out",
                str(tmp_path),
                "--label",
                "split",
            ]
        )
        == 0
    )
    split = json.loads((tmp_path / "split.json").read_text())["modes"]["disaggregated"]
    assert split["tried"]
