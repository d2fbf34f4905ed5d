"""Two processes x 4 CPU devices over loopback train like one process with 8 devices."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jzero.cli import main

TINY = ["--set", "model.n_layers=1", "--set", "model.seq_len=16", "--set", "model.d_model=32", "--set", "model.d_ff=64",
        "--set", "data.kind=synthetic", "--set", "train.global_batch=16", "--set", "train.steps=4", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path", ["spec", "flat"])
def test_two_processes_match_one(path, tmp_path):
    sets = ["--set", f"zero.path={path}", "--set", "mesh.dp=4", "--set", "mesh.tp=2"]
    assert main(["train", "--out", str(tmp_path / "single"), *TINY, *sets]) == 0
    single = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]

    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jzero.cli", "train", "--out", str(tmp_path / "multi"), *TINY, *sets,
             "--set", "train.host_devices=4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "per-device memory" in outs[0][0] and "per-device memory" not in outs[1][0]  # process 0 reports
    multi = [json.loads(x) for x in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([m["loss"] for m in multi], [s["loss"] for s in single], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in multi], [s["grad_norm"] for s in single], rtol=1e-5)
