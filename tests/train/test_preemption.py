"""SIGTERM ends a run within seconds from any phase (real processes, real signals): one line, exit 143.

During the steps the run finishes its step and saves it (tests/train/test_checkpoint.py's
`test_sigterm_saves_the_step_exits_143_and_the_same_command_continues`); before the first step there
is none to save, and a compile in C++ does not hold the exit up.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import stderr_lines
from jzero.train.preemption import GRACE_S

# 24 unscanned blocks: their compile takes many seconds on CPU, the model stays tiny.
SLOW_COMPILE = ["model.n_layers=24", "model.d_model=32", "model.d_ff=64", "model.seq_len=16", "data.kind=synthetic",
                "train.steps=3"]


def _start(out, *flags):
    args = [a for kv in SLOW_COMPILE for a in ("--set", kv)]
    return subprocess.Popen([sys.executable, "-m", "jzero.cli", "train", "--out", str(out), *args, *flags],
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ends_after_sigterm(proc) -> tuple[str, float]:
    """stderr's lines (JAX's import noise dropped) and the seconds from SIGTERM to the exit, asserted 143."""
    proc.send_signal(signal.SIGTERM)
    t = time.monotonic()
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    seconds = time.monotonic() - t
    assert proc.returncode == 143, err[-3000:]
    return stderr_lines(err), seconds


@pytest.mark.slow
def test_sigterm_during_the_compile_ends_the_run_at_once(tmp_path):
    """Before, a run compiling a large step ignored SIGTERM (still alive 60 s later)."""
    proc = _start(tmp_path / "out")
    assert proc.stdout.readline() == "compiling the train step\n"  # process 0, with progress on
    time.sleep(0.5)
    lines, seconds = _ends_after_sigterm(proc)
    assert lines == ["jzero: stopped: SIGTERM during compile: no step taken, so none to save; exiting"]
    assert seconds < 3 < GRACE_S
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sigterm_during_start_up_ends_the_run_at_once(tmp_path):
    proc = _start(tmp_path / "out", "--quiet")
    time.sleep(3)  # importing JAX, building the run: before the first step
    lines, seconds = _ends_after_sigterm(proc)
    assert len(lines) == 1 and re.fullmatch(
        r"jzero: stopped: SIGTERM during (start-up|restore|compile): no step taken, so none to save; exiting", lines[0]
    ), lines
    assert seconds < 3


@pytest.mark.slow
def test_a_step_that_does_not_finish_after_sigterm_is_abandoned_after_the_grace(tmp_path):
    """The step in flight would save and exit 143; one that hangs is given GRACE_S, then the run ends."""
    out = tmp_path / "out"
    sets = ["model.impl=helpers.stuck_model:SlowStepModel", "model.d_model=32", "model.d_ff=64", "model.seq_len=16",
            "data.kind=synthetic", "train.steps=100", f"checkpoint.dir={tmp_path / 'ck'}"]
    tests = Path(__file__).parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent)]))
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", "train", "--out", str(out), "--quiet",
                             *[a for kv in sets for a in ("--set", kv)]], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "no steps"
        time.sleep(0.1)
    time.sleep(1)  # inside the third step, which does not return
    lines, seconds = _ends_after_sigterm(proc)
    assert lines == [f"jzero: stopped: SIGTERM: the step in flight and its save did not finish within {GRACE_S:.0f} s; "
                     "the newest complete checkpoint is kept; exiting"]
    assert GRACE_S <= seconds < GRACE_S + 2
