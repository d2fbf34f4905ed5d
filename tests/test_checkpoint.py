"""orbax checkpoints on disk: exact resume, resharding across mesh/strategy/path, faults."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jzero.cli import main

TINY = ["--set", "model.n_layers=1", "--set", "model.seq_len=16", "--set", "model.d_model=32", "--set", "model.d_ff=64",
        "--set", "data.kind=synthetic", "--set", "train.global_batch=16", "--quiet"]
STEPS = 6


def sets(**kv):
    return [a for k, v in kv.items() for a in ("--set", f"{k.replace('__', '.')}={v}")]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(out, *extra):
    code = main(["train", "--out", str(out), *TINY, *sets(train__steps=STEPS), *extra])
    assert code == 0
    return metrics(out)


def cli(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """ZeRO-2 flat dp=8, 6 steps, checkpoints after steps 3 and 6."""
    root = tmp_path_factory.mktemp("ckpt")
    rows = train(root / "out", *sets(checkpoint__dir=root / "ck", checkpoint__every=3, zero__path="flat"))
    assert sorted(os.listdir(root / "ck")) == ["3", "6"]
    return root, rows


def copy_without_last(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    shutil.rmtree(dst / str(STEPS))
    return dst


def test_exact_resume_is_bitwise(base, tmp_path):
    root, rows = base
    ck = copy_without_last(root / "ck", tmp_path / "ck")
    resumed = train(tmp_path / "out", *sets(zero__path="flat"), "--resume", str(ck))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(resumed, rows[3:]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert sorted(os.listdir(ck)) == ["3", "6"]  # the resumed run kept checkpointing there


def test_resume_onto_other_mesh_strategy_and_path(base, tmp_path):
    """optim_grads flat dp=8 -> optim spec dp=4 tp=2 -> no_shard dp=1 (one device, a new process)."""
    root, rows = base
    ck = copy_without_last(root / "ck", tmp_path / "ck")
    resumed = train(tmp_path / "a", *sets(zero__strategy="optim", mesh__dp=4, mesh__tp=2), "--resume", str(ck))
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in rows[3:]], rtol=1e-5)
    # The spec run's step-6 checkpoint now restores on a single device as DDP.
    proc = cli("train", "--out", str(tmp_path / "b"), *TINY, *sets(train__steps=8, train__host_devices=1, mesh__dp=1,
               zero__strategy="no_shard"), "--resume", str(ck))
    assert proc.returncode == 0, proc.stderr[-2000:]
    more = metrics(tmp_path / "b")
    assert [r["step"] for r in more] == [7, 8]
    uninterrupted = train(tmp_path / "c", *sets(train__steps=8))
    np.testing.assert_allclose([r["loss"] for r in more], [r["loss"] for r in uninterrupted[6:]], rtol=1e-5)


def test_shape_mismatch_lists_the_arrays(base, capsys, tmp_path):
    root, _ = base
    args = [*TINY, *sets(train__steps=STEPS, model__d_ff=128), "--resume", str(root / "ck")]
    code = main(["train", "--out", str(tmp_path), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not fit the model" in err and "blocks/0/mlp/fc1/kernel: checkpoint [32, 64] vs model [32, 128]" in err


def test_corrupted_checkpoint_names_the_step_and_falls_back_only_if_asked(base, capsys, tmp_path):
    root, rows = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    for f in (ck / str(STEPS) / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data files
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, zero__path="flat"), "--resume", str(ck)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"checkpoint step {STEPS}" in err and "unreadable" in err
    assert main(argv + ["--resume-fallback"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "o")] == [4, 5, 6, 7, 8]


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    ck = tmp_path / "ck"
    args = ["train", "--out", str(tmp_path / "o"), *TINY]
    args += sets(train__steps=100000, checkpoint__dir=ck, checkpoint__every=1)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jzero.cli", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len([p for p in ck.glob("*") if p.name.isdigit()]) < 3:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # saving every step: the kill lands in or between saves
    finally:
        proc.wait()
    committed = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists())
    assert committed, "no checkpoint was committed before the kill"
    proc = cli("train", "--out", str(tmp_path / "r"), *TINY, *sets(train__steps=committed[-1] + 1, checkpoint__dir=ck),
               "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in metrics(tmp_path / "r")] == [committed[-1] + 1]


def test_ckpt_info(base, capsys):
    root, _ = base
    assert main(["ckpt", "info", str(root / "ck")]) == 0
    out = capsys.readouterr().out
    assert "steps 3, 6" in out and "strategy=optim_grads path=flat" in out and "dp=8" in out
    assert "params/blocks/0/mlp/fc1/kernel" in out and "(32, 64)" in out
    assert main(["ckpt", "info", "/no/such/dir"]) == 2
