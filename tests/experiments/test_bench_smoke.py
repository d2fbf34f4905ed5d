"""experiments/bench/run.py still runs against jzero's API, and its shard_map ZeRO-2 does jzero's work.

One timed step of the smallest selection (the hand-written shard_map ZeRO-2 beside jzero's spec DDP,
the check's reference) on the bench's smoke model (the tiny GPT with one block), in its own process:
the bench starts JAX itself (8 simulated devices).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.programs import needs_gpu_plugin

BENCH = Path(__file__).resolve().parents[2] / "experiments" / "bench" / "run.py"


@pytest.mark.slow
def test_bench_runs_and_its_baseline_matches_jzero(tmp_path):
    cmd = [sys.executable, str(BENCH), "--models", "smoke", "--only", "hand-shard_map", "--warmup", "1", "--steps", "1",
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    (row,) = result["models"]["smoke"]["rows"]
    assert (row["impl"], row["stage"]) == ("hand-shard_map", "ZeRO-2")
    assert row["check"]["ok"], row["check"]
    assert 1.0 <= row["wire_ratio_to_theory"] <= 1.01  # one psum_scatter + one all_gather, padded to d
    assert (tmp_path / "table.md").is_file() and (tmp_path / "bench.png").is_file()


@pytest.mark.slow
@needs_gpu_plugin
def test_roofline_reads_the_gpu_benchs_programs(tmp_path):
    """experiments/bench/roofline.py compiles the GPU bench's three programs deviceless for an H200 and reads
    their roofline: the same matmul flops in each (one model, one loss), none on fp32 operands in bf16. In this
    process (its `main` only adds starting JAX and writing the table)."""
    spec = importlib.util.spec_from_file_location("bench_roofline", BENCH.parent / "roofline.py")
    roofline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roofline)
    rows = roofline.bench_model("smoke", roofline.parse_args(["--models", "smoke"]))
    assert [r["impl"] for r in rows] == ["jzero-spec", "jzero-flat", "plain-optax"]
    assert len({round(r["dot_tflop"], 9) for r in rows}) == 1 and all(r["fp32_dot_tflop"] == 0 for r in rows)
    assert rows[-1]["x_plain_optax"] == 1.0 and all(0 < r["mfu"] < 1 for r in rows)
    assert roofline.table(rows).count("| smoke |") == 3
