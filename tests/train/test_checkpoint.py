"""orbax checkpoints on disk: exact resume, resharding across mesh/strategy/path, ownership,
integrity, and runs that fail or are stopped while saving (real files, real processes)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from jzero.cli import main
from jzero.errors import CheckpointError
from jzero.train import ckpt_dir
from jzero.train.ckpt_step import read_meta
from jzero.train.preemption import GRACE_S

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


def cli(*args, timeout=300, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def step_dir(ck: Path, step: int) -> Path:
    return ck / f"step_{step:08d}"


def saved_steps(ck: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ck.glob("step_" + "[0-9]" * 8) if (p / "commit_success.txt").exists())


def bounded(fn, *args, seconds=30):
    """fn(*args), asserted to return within `seconds` (a daemon thread: a hang fails the test, not the session)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__}{args} did not return in {seconds} s"
    return result[0]


def one_line(err: str) -> str:
    """The CLI's stderr, asserted to be exactly one `jzero:` line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("jzero: "), err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """ZeRO-2 flat dp=8, 6 steps, checkpoints after steps 3 and 6."""
    root = tmp_path_factory.mktemp("ckpt")
    rows = train(root / "out", *sets(checkpoint__dir=root / "ck", checkpoint__every=3, zero__path="flat"))
    assert saved_steps(root / "ck") == [3, 6]
    return root, rows


def copy_without_last(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    shutil.rmtree(step_dir(dst, STEPS))
    return dst


@pytest.mark.slow
def test_exact_resume_is_bitwise_and_continues_the_metrics(base, tmp_path):
    root, rows = base
    ck = copy_without_last(root / "ck", tmp_path / "ck")
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)  # the same --out: its rows up to step 3 stay, 4..6 are rewritten
    resumed = train(out, *sets(zero__path="flat"), "--resume", str(ck))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, rows):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert saved_steps(ck) == [3, 6]  # the resumed run kept checkpointing there


SPIKY = sets(train__grad_norm_spike_factor=1.02, train__grad_norm_spike_window=2)  # the tiny GPT's norms wobble by more


@pytest.mark.slow
def test_the_spike_guards_skips_show_in_the_metrics_and_resume_bitwise(tmp_path):
    """Steps whose grad norm spikes are skipped (metrics spike_skipped, the learning rate held, the summary's
    list); resumed from step 3, steps 4-6 are bitwise the uninterrupted run's, skips included: the history
    comes back with the checkpoint (a fresh one, which needs 2 norms first, could not skip step 4 or 5)."""
    flat = sets(zero__path="flat")
    whole = train(tmp_path / "whole", *flat, *SPIKY, *sets(checkpoint__dir=tmp_path / "ck0", checkpoint__every=3))
    skipped = [r["step"] for r in whole if r["spike_skipped"]]
    assert skipped and skipped[-1] in (4, 5) and all(whole[s - 1]["skipped"] == 1.0 for s in skipped)
    for s in skipped:  # a skipped step leaves the optimizer's step count, and so the next step's lr, where it was
        assert whole[s]["lr"] == whole[s - 1]["lr"]
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["spike_skipped_steps"] == skipped
    ck = copy_without_last(tmp_path / "ck0", tmp_path / "ck")
    resumed = train(tmp_path / "resumed", *flat, *SPIKY, "--resume", str(ck))
    keys = ("loss", "grad_norm", "lr", "skipped", "spike_skipped")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[3:]]


@pytest.mark.slow
def test_the_spike_history_crosses_guard_settings(base, tmp_path, capsys):
    """A checkpoint saved without the guard resumes with it (a fresh history), one saved with it resumes
    without it, or with another window (a note says the history starts anew)."""
    root, _ = base
    spiky = train(tmp_path / "a", *SPIKY, "--resume", str(copy_without_last(root / "ck", tmp_path / "ck")))
    assert not any(r["spike_skipped"] for r in spiky)  # steps 4-6 fill the new window of 2; none can be skipped
    train(tmp_path / "b", *SPIKY, *sets(checkpoint__dir=tmp_path / "ck1", checkpoint__every=3))
    capsys.readouterr()
    plain = train(tmp_path / "c", "--resume", str(copy_without_last(tmp_path / "ck1", tmp_path / "ck2")))
    assert "spike_skipped" not in plain[0]
    wider = sets(train__grad_norm_spike_factor=1.02, train__grad_norm_spike_window=3)
    train(tmp_path / "d", *wider, "--resume", str(copy_without_last(tmp_path / "ck1", tmp_path / "ck3")))
    assert "the guard starts a new history" in capsys.readouterr().err


@pytest.mark.slow
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


@pytest.mark.slow
def test_offloaded_state_restores_into_host_memory_and_saves_what_no_offload_saves(tmp_path):
    """The run resumed from step 3 with all its optimizer state in host memory (zero.offload_fraction=1;
    jit refuses state arrays in another memory than its shardings') trains bitwise as the run without
    offload, and its step-6 checkpoint holds the same arrays: checkpoints move between fractions.
    Bitwise at XLA's default code generation, which both runs get here (subprocesses): at the suite's
    -O0 (tests/conftest.py) the host-memory update's last bits differ from the device one's. Without the
    non-finite guard: its select joins the update's fusion, which XLA:CPU then compiles differently for the
    state copied in from host memory (the last bits differ; docs/offload.md)."""
    o2 = {"XLA_FLAGS": "--xla_backend_optimization_level=2"}
    base = [*TINY, *sets(train__steps=STEPS, zero__path="flat", train__check_for_nan_in_loss_and_grad=False)]
    proc = cli("train", "--out", str(tmp_path / "base"), *base, *sets(checkpoint__dir=tmp_path / "ck0",
               checkpoint__every=3), env=o2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ck = copy_without_last(tmp_path / "ck0", tmp_path / "ck")
    proc = cli("train", "--out", str(tmp_path / "out"), *base, *sets(zero__offload_fraction=1.0), "--resume", str(ck),
               env=o2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows, resumed = metrics(tmp_path / "base"), metrics(tmp_path / "out")
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in rows[3:]]
    offloaded, plain = read_meta(ck, STEPS)["arrays"], read_meta(tmp_path / "ck0", STEPS)["arrays"]
    assert offloaded == plain


def test_shape_mismatch_lists_the_arrays(base, capsys, tmp_path):
    root, _ = base
    args = [*TINY, *sets(train__steps=STEPS, model__d_ff=128), "--resume", str(root / "ck")]
    code = main(["train", "--out", str(tmp_path), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not fit the model" in err and "blocks/0/mlp/fc1/kernel: checkpoint [32, 64] vs model [32, 128]" in err


# ---------------------------------------------------------------- ownership


@pytest.mark.parametrize("folders", [["1", "2", "3"], ["2024"]])
def test_a_directory_jzero_did_not_create_is_never_written(folders, capsys, tmp_path):
    """A user's number-named folders are not steps: nothing is deleted, skipped or written there."""
    ck = tmp_path / "mine"
    for name in folders:
        (ck / name).mkdir(parents=True)
        (ck / name / "notes.txt").write_text(name)
    before = sorted(str(p.relative_to(ck)) for p in ck.rglob("*"))
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=2, checkpoint__dir=ck, checkpoint__keep=2)]
    assert main(argv) == 2
    assert "not empty" in one_line(capsys.readouterr().err)
    assert sorted(str(p.relative_to(ck)) for p in ck.rglob("*")) == before
    assert main(argv + ["--resume"]) == 2
    assert "not a jzero checkpoint directory" in one_line(capsys.readouterr().err)


def test_a_symlinked_step_is_not_jzeros_and_keep_never_follows_it(base, tmp_path):
    """A step folder that is a symlink (to another run's step) is neither resumed from nor cleaned up by
    `checkpoint.keep`: deleting through it would reach a folder this run did not write."""
    root, _ = base
    ck, elsewhere = tmp_path / "ck", tmp_path / "another_runs_step"
    shutil.copytree(root / "ck", ck)
    shutil.move(step_dir(ck, 3), elsewhere)
    step_dir(ck, 3).symlink_to(elsewhere)
    before = sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*"))
    assert ckpt_dir.steps(ck) == [STEPS]
    args = sets(train__steps=STEPS + 2, checkpoint__dir=ck, checkpoint__every=2, checkpoint__keep=1)
    assert main(["train", "--out", str(tmp_path / "o"), *TINY, *args, "--resume"]) == 0
    assert ckpt_dir.steps(ck) == [STEPS + 2]
    assert list((ck / ckpt_dir.DELETING).iterdir()) == []  # step 6 dropped, renamed there, then deleted
    assert step_dir(ck, 3).is_symlink()
    assert sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")) == before


@pytest.mark.slow
def test_a_fresh_run_into_an_old_runs_directory_is_refused(base, capsys, tmp_path):
    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    (ck / "step_00000009").mkdir()  # a folder with a step's name that jzero did not write
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, checkpoint__dir=ck)]
    assert main(argv) == 2
    assert "holds steps 3, 6 of an earlier run" in one_line(capsys.readouterr().err)
    assert saved_steps(ck) == [3, 6]
    (ck / "step_00000008").mkdir()  # ... and one where the run would save next: not replaced
    (ck / "step_00000008" / "notes.txt").write_text("mine")
    assert main(argv + ["--resume"]) == 2
    assert "cannot save checkpoint step 8" in one_line(capsys.readouterr().err)
    assert (ck / "step_00000008" / "notes.txt").read_text() == "mine"
    shutil.rmtree(ck / "step_00000008")
    assert main(argv + ["--resume", "--set", "checkpoint.keep=1"]) == 0  # continues it; keep=1 deletes only its own
    assert saved_steps(ck) == [8] and (ck / "step_00000009").is_dir()


@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_first_holds_the_lock(capsys, tmp_path):
    ck = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jzero.train.ckpt_dir import claim; "
         "held = claim(sys.argv[1], 'test', False); print('claimed', flush=True); time.sleep(120)", str(ck)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=2, checkpoint__dir=ck)]
        assert main(argv) == 2
        assert f"in use by another jzero run (pid {holder.pid}" in one_line(capsys.readouterr().err)
        assert main(argv + ["--resume"]) == 2  # it said "starting from step 0" before it was refused
        out, err = capsys.readouterr()
        assert "in use by another jzero run" in one_line(err) and "starting from step" not in out
    finally:
        holder.kill()
        holder.wait()
    assert main(argv) == 0  # a dead holder's lock is gone with it


def test_checkpoint_dir_that_is_a_file_fails_before_training(capsys, tmp_path):
    (tmp_path / "ck").write_text("mine")
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=2, checkpoint__dir=tmp_path / "ck")]
    assert main(argv) == 2
    assert "is a file, not a directory" in one_line(capsys.readouterr().err)
    assert (tmp_path / "ck").read_text() == "mine" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("runs", [["x"], [{}], [{"started": 1, "host": "h"}]])
def test_a_damaged_marker_is_one_line(runs, capsys, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ckpt_dir.MARKER).write_text(json.dumps({"format": ckpt_dir.FORMAT, "runs": runs}))
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=2, checkpoint__dir=ck)]
    for args in (argv, argv + ["--resume"], ["ckpt", "info", str(ck)]):
        assert main(args) == 2
        assert f"{ck}: {ckpt_dir.MARKER} is damaged" in one_line(capsys.readouterr().err)


def test_a_symlink_loop_as_checkpoint_dir_is_one_line(capsys, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=2, checkpoint__dir=loop)]
    for args in (argv, argv + ["--resume"]):
        assert main(args) == 2
        assert f"checkpoint.dir {loop} cannot be resolved" in one_line(capsys.readouterr().err)
    with pytest.raises(CheckpointError, match=f"^checkpoint.dir {loop} cannot be resolved"):
        ckpt_dir.claim(loop, "sha", resume=False)


def test_a_fifo_as_the_marker_is_refused_not_read(capsys, tmp_path):
    """Reading a named pipe blocks until something writes to it: forever."""
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / ckpt_dir.MARKER)
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=2), "--resume", str(ck)]
    for args in (["ckpt", "info", str(ck)], ["ckpt", "info", "--verify", str(ck)], argv):
        assert bounded(main, args) == 2
        assert f"{ck}: {ckpt_dir.MARKER} is not a regular file" in one_line(capsys.readouterr().err)


def test_a_backslash_in_checkpoint_dir_is_refused_before_tensorstore_writes_outside_it(capsys, tmp_path):
    """TensorStore reads a backslash as a separator: the arrays of `a\\b` went to `a/b` and the run exited 0."""
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=2, checkpoint__dir=tmp_path / "a\\b")]
    assert main(argv) == 2
    assert "has a backslash in it" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "a").exists() and not (tmp_path / "a\\b").exists()


def test_a_lock_that_is_a_symlink_is_refused_not_written_through(capsys, tmp_path):
    ck, victim = tmp_path / "ck", tmp_path / "notes.txt"
    ck.mkdir()
    victim.write_text("mine")
    (ck / ckpt_dir.LOCK).symlink_to(victim)
    with pytest.raises(CheckpointError, match=f"{ckpt_dir.LOCK} is not a regular file"):
        ckpt_dir.claim(ck, "sha", resume=False)
    assert victim.read_text() == "mine"


def test_keep_drops_a_step_in_one_rename_and_the_next_writer_deletes_what_a_kill_left(base, tmp_path, monkeypatch):
    """`checkpoint.keep`'s clean-up renames a dropped step into `deleting/` before deleting it: a kill while
    it deletes (SIGKILL after a scheduler's grace period) left a half-deleted `step_*` among the steps, one
    whose meta was gone counted as not jzero's, and a later save of that step number was refused."""
    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    monkeypatch.setattr(ckpt_dir, "purge_deleting", lambda directory: None)  # as if killed before deleting
    args = sets(train__steps=STEPS + 2, checkpoint__dir=ck, checkpoint__every=2, checkpoint__keep=1)
    assert main(["train", "--out", str(tmp_path / "o"), *TINY, *args, "--resume"]) == 0
    monkeypatch.undo()
    assert ckpt_dir.steps(ck) == [STEPS + 2]
    dropped = ck / ckpt_dir.DELETING
    assert sorted(p.name for p in dropped.iterdir()) == [step_dir(ck, 3).name, step_dir(ck, STEPS).name]
    assert all(ckpt_dir.is_step(p) for p in dropped.iterdir())  # whole: renamed, not deleted in place
    shutil.rmtree(dropped / step_dir(ck, 3).name / "meta")  # what a kill in the middle of deleting it leaves
    elsewhere = tmp_path / "not_jzeros"
    elsewhere.mkdir()
    (elsewhere / "x").write_text("keep me")
    (dropped / "step_00000099").symlink_to(elsewhere)
    (dropped / "notes.txt").write_text("a user's")
    ckpt_dir.claim(ck, "sha", resume=True).release()  # the next run that writes here
    assert sorted(p.name for p in dropped.iterdir()) == ["notes.txt", "step_00000099"]
    assert (elsewhere / "x").read_text() == "keep me"
    assert ckpt_dir.steps(ck) == [STEPS + 2]


def test_a_first_claim_that_failed_leaves_nothing_that_refuses_the_next(tmp_path, monkeypatch):
    """A full disk while the marker was written left `jzero.lock` and an empty marker `.tmp`, and every later
    run into the directory was refused ("not empty ... jzero did not create it")."""
    ck = tmp_path / "ck"
    real = Path.write_text

    def full(self, *args, **kwargs):
        real(self, "")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        ckpt_dir.claim(ck, "sha", resume=False)
    monkeypatch.undo()
    assert [p.name for p in ck.iterdir()] in ([], [ckpt_dir.LOCK])  # at most its lock, which a claim accepts
    (ck / ckpt_dir.LOCK).write_text("")  # another run's claim in flight: its lock and marker tmp
    (ck / (ckpt_dir.MARKER + ".tmp")).write_text("")
    ckpt_dir.claim(ck, "sha", resume=False).release()
    assert ckpt_dir.read_marker(ck) is not None


@pytest.mark.parametrize("async_save, failed_run", [(True, False), (False, False), (True, True)])
def test_a_save_that_never_ends_stops_the_run_within_checkpoint_timeout(async_save, failed_run, tmp_path, monkeypatch):
    """A stalled filesystem (a save's write that never returns) is a one-line RunError after
    `checkpoint.timeout_s`, and closing the Checkpointer does not wait for the save again (orbax's close would);
    nor does a run that failed otherwise (a NaN) with that save in flight: its close waits as long, quietly."""
    from helpers import tiny_config
    from jzero.errors import RunError
    from jzero.train.checkpoint import Checkpointer
    from jzero.train.loop import setup

    run = setup(tiny_config())
    ck = Checkpointer(tmp_path / "ck", run, keep=1, async_save=async_save, timeout_s=1)
    stall = threading.Event()
    name = "wait_until_finished" if async_save else "save"
    real = getattr(ck.manager, name)

    def stalled(*args, **kwargs):
        if threading.current_thread().name == "jzero-checkpoint-save":  # not orbax's own wait inside its save
            stall.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(ck.manager, name, stalled)
    raised = []

    def save_and_close():
        try:
            ck.save(run.init_state(), run.cfg)
            if not failed_run:
                ck.check_saved()
        except RunError as e:
            raised.append(str(e))
        ck.close(check=False)

    start = time.monotonic()
    bounded(save_and_close, seconds=60)
    assert time.monotonic() - start < 30
    if failed_run:  # the run's own failure is its report
        assert raised == []
    else:
        assert len(raised) == 1 and "not written to" in raised[0] and "checkpoint.timeout_s=1 s" in raised[0], raised
    stall.set()  # the write goes on and ends: nothing of the test is left running


def test_a_writer_keeps_at_least_one_step(tmp_path):
    from helpers import tiny_config
    from jzero.train.checkpoint import Checkpointer
    from jzero.train.loop import setup

    run = setup(tiny_config())
    for keep in (0, -1, 1.5):
        with pytest.raises(CheckpointError, match=r"^keep=.*: a writer keeps at least its newest step"):
            Checkpointer(tmp_path / "ck", run, keep=keep)
    assert not (tmp_path / "ck").exists()


def test_verify_without_a_complete_step_is_refused_as_info_is(capsys, tmp_path):
    ck = tmp_path / "ck"
    ckpt_dir.claim(ck, "sha", resume=False).release()  # the marker only
    for contents in ([], ["step_00000002.orbax-checkpoint-tmp"]):  # ... and a save that never committed
        for name in contents:
            (ck / name).mkdir()
        for args in (["ckpt", "info", str(ck)], ["ckpt", "info", "--verify", str(ck)]):
            assert main(args) == 2
            assert f"no complete checkpoint in {ck}" in one_line(capsys.readouterr().err)


def test_verify_drops_the_noise_of_orbaxs_abandoned_reads(monkeypatch, capsys, tmp_path):
    """A damaged step's reads, abandoned, end in 'Event loop is closed' tracebacks after jzero's line:
    --verify installs the hook that drops them (`jzero.train.unraisable`), as the Checkpointer does."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    ckpt_dir.claim(tmp_path, "sha", resume=False).release()
    assert main(["ckpt", "info", "--verify", str(tmp_path)]) == 2
    capsys.readouterr()
    closed, other = RuntimeError("Event loop is closed"), ValueError("mine")
    for e in (closed, other):
        sys.unraisablehook(types.SimpleNamespace(exc_value=e, object=None))
    assert [u.exc_value for u in seen] == [other]


# ---------------------------------------------------------------- integrity


def test_overwritten_arrays_are_caught_by_resume_and_verify(base, capsys, tmp_path):
    """Step 6's files replaced by step 3's: every file is valid, the values are not step 6's."""
    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    shutil.rmtree(step_dir(ck, STEPS) / "state")
    shutil.copytree(step_dir(ck, 3) / "state", step_dir(ck, STEPS) / "state")
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, zero__path="flat"), "--resume", str(ck)]
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert f"checkpoint step {STEPS} in {ck} is damaged" in line and "differ from the fingerprints" in line
    assert main(["ckpt", "info", "--verify", str(ck)]) == 2
    captured = capsys.readouterr()
    assert "step 3: verified" in captured.out and f"step {STEPS}: DAMAGED" in captured.out
    assert f"damaged checkpoint steps in {ck}: {STEPS}" in one_line(captured.err)


def test_unreadable_metadata_is_a_damaged_step_not_a_missing_one(base, capsys, tmp_path):
    """Damaged meta neither hides a step (resuming silently from an older one) nor, once every
    step is moved aside, lets an always---resume job script start again from step 0."""
    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    for step in (3, STEPS):
        meta = step_dir(ck, step) / "meta" / "metadata"
        meta.write_text(meta.read_text()[:20])
    assert main(["ckpt", "info", "--verify", str(ck)]) == 2
    assert f"step {STEPS}: DAMAGED" in capsys.readouterr().out
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, checkpoint__dir=ck), "--resume"]
    assert main(argv) == 2
    assert f"checkpoint step {STEPS} in {ck}: metadata unreadable" in one_line(capsys.readouterr().err)
    assert main(argv + ["--resume-fallback"]) == 2
    assert "no undamaged checkpoint left" in capsys.readouterr().err
    assert main(argv) == 2
    assert "no complete checkpoint" in one_line(capsys.readouterr().err)
    assert len(list((ck / "damaged").iterdir())) == 2 and not (tmp_path / "o" / "metrics.jsonl").exists()


@pytest.mark.parametrize("damage", ["no_arrays", "not_jzeros", "meta_is_a_file", "bad_dtype", "fifo_in_state"])
def test_meta_not_as_jzero_writes_it_or_a_fifo_in_a_step_is_a_damaged_step(damage, base, capsys, tmp_path):
    """Meta that parses but is not jzero's (or whose arrays are not as jzero writes them), a meta item that is a
    file, and a FIFO among the state's files: a damaged step, named in one line, never a traceback, a hang or a
    step hidden (before: KeyError tracebacks, a silent resume from step 3, a read blocked forever)."""
    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    meta = step_dir(ck, STEPS) / "meta" / "metadata"
    if damage == "no_arrays":
        meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "arrays"}))
    elif damage == "not_jzeros":
        meta.write_text("[1, 2]")
    elif damage == "meta_is_a_file":
        shutil.rmtree(meta.parent)
        meta.parent.write_text("x")
    elif damage == "bad_dtype":
        m = json.loads(meta.read_text())
        m["arrays"]["params/tok_emb"]["dtype"] = "float33"
        meta.write_text(json.dumps(m))
    else:
        files = (p for p in (step_dir(ck, STEPS) / "state").rglob("*") if p.is_file())
        data = max(files, key=lambda p: p.stat().st_size)
        data.unlink()
        os.mkfifo(data)
    assert ckpt_dir.steps(ck) == [3, STEPS]
    assert bounded(main, ["ckpt", "info", "--verify", str(ck)]) == 2
    assert f"step {STEPS}: DAMAGED" in capsys.readouterr().out
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, checkpoint__dir=ck), "--resume"]
    assert bounded(main, argv) == 2
    err = one_line(capsys.readouterr().err)
    assert f"checkpoint step {STEPS} in {ck}: " in err and "unreadable (" in err


def test_an_out_of_memory_during_a_restore_is_not_damage_the_fallback_moves_aside(base, capsys, tmp_path,
                                                                                  monkeypatch):
    """A device out of memory while the arrays are read was "unreadable": `--resume-fallback` then moved the
    newest good step to damaged/."""
    import orbax.checkpoint as ocp

    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    restore = ocp.CheckpointManager.restore

    def oom(self, step, args=None, **kwargs):
        if args is not None and "state" in args:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
        return restore(self, step, args=args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", oom)
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, checkpoint__dir=ck), "--resume",
            "--resume-fallback"]  # fmt: skip
    assert main(argv) != 0
    assert f"out of memory during the restore of checkpoint step {STEPS}" in one_line(capsys.readouterr().err)
    assert ckpt_dir.steps(ck) == [3, STEPS] and not (ck / ckpt_dir.DAMAGED).exists()


def test_a_read_error_that_passes_is_not_damage_the_fallback_moves_aside(base, capsys, tmp_path, monkeypatch):
    """A network filesystem's passing read error (EIO once) made `--resume-fallback` move the newest good step
    to damaged/ and resume from an older one; the step is read again before it counts as damaged."""
    import orbax.checkpoint as ocp

    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    restore, failed = ocp.CheckpointManager.restore, []

    def once(self, step, args=None, **kwargs):
        if args is not None and "state" in args and not failed:
            failed.append(step)
            raise OSError(5, "Input/output error")
        return restore(self, step, args=args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", once)
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, checkpoint__dir=ck), "--resume",
            "--resume-fallback"]  # fmt: skip
    assert main(argv) == 0
    assert failed == [STEPS] and f"resuming from checkpoint step {STEPS}" in capsys.readouterr().out
    assert not (ck / ckpt_dir.DAMAGED).exists()


def test_a_meta_read_error_that_passes_is_not_damage_either(base, capsys, tmp_path, monkeypatch):
    from jzero.train import checkpoint

    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    real, failed = checkpoint.read_meta, []

    def once(directory, step, manager=None):
        if not failed:
            failed.append(step)
            raise CheckpointError(f"checkpoint step {step} in {directory}: metadata unreadable (OSError: EIO)")
        return real(directory, step, manager)

    monkeypatch.setattr(checkpoint, "read_meta", once)
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, checkpoint__dir=ck), "--resume",
            "--resume-fallback"]  # fmt: skip
    assert main(argv) == 0
    assert failed == [STEPS] and not (ck / ckpt_dir.DAMAGED).exists()


def test_a_deleting_folder_that_is_a_link_is_refused_never_followed(tmp_path):
    """orbax renames the steps `keep` drops into `deleting/`: through a symlink they would land, and be deleted,
    in the folder it points at."""
    ck, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    ckpt_dir.claim(ck, "sha", resume=False).release()
    (elsewhere / "step_00000001").mkdir(parents=True)
    (ck / ckpt_dir.DELETING).symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"deleting is not a folder \(a symlink or a file"):
        ckpt_dir.claim(ck, "sha", resume=False)
    ckpt_dir.purge_deleting(ck)
    assert (elsewhere / "step_00000001").is_dir()


def test_a_step_whose_meta_is_another_tools_format_is_never_counted(base, tmp_path):
    """A `step_*` with state/ and a meta of another format is not jzero's: never counted, so never deleted by
    `checkpoint.keep` nor moved aside (meta with no format, or unreadable, is jzero's damaged step)."""
    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    (step_dir(ck, 3) / "meta" / "metadata").write_text(json.dumps({"format": "someone-elses/2"}))
    assert ckpt_dir.steps(ck) == [STEPS]


def test_a_fifo_beside_a_steps_items_hides_the_step_rather_than_block_its_listing(base, tmp_path):
    """orbax reads each listed step's `_CHECKPOINT_METADATA` as it opens the directory: a FIFO there blocked
    `ckpt info` forever. jzero writes no FIFO, so that folder is not its step (nor deleted, nor saved over)."""
    root, _ = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    (step_dir(ck, STEPS) / "_CHECKPOINT_METADATA").unlink()
    os.mkfifo(step_dir(ck, STEPS) / "_CHECKPOINT_METADATA")
    assert ckpt_dir.steps(ck) == [3]
    assert bounded(main, ["ckpt", "info", "--verify", str(ck)]) == 0


def test_a_directory_that_resume_only_reads_is_left_as_it_is_by_the_fallback(base, capsys, tmp_path):
    """`--resume A --resume-fallback` beside checkpoint.dir=B skips A's damaged newest step without moving it
    into A/damaged/ (A may be another run's, live, or read-only); B gets this run's steps."""
    root, _ = base
    a = tmp_path / "A"
    shutil.copytree(root / "ck", a)
    meta = step_dir(a, STEPS) / "meta" / "metadata"
    meta.write_text(meta.read_text()[:20])
    before = sorted(str(p.relative_to(a)) for p in a.rglob("*"))
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=4, checkpoint__dir=tmp_path / "B"),
            "--resume", str(a), "--resume-fallback"]  # fmt: skip
    assert main(argv) == 0
    said = capsys.readouterr()
    assert f"skipped it (left in place: this run reads {a}" in said.err
    assert f"resuming from checkpoint step 3 in {a}" in said.out
    assert sorted(str(p.relative_to(a)) for p in a.rglob("*")) == before
    assert saved_steps(tmp_path / "B") == [4]


@pytest.mark.slow
def test_truncated_step_falls_back_quietly_moves_aside_and_is_saved_again(base, capsys, tmp_path):
    root, rows = base
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck", ck)
    for f in (step_dir(ck, STEPS) / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data files
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    assert main(["ckpt", "info", "--verify", str(ck)]) == 2
    assert f"step {STEPS}: DAMAGED: unreadable" in capsys.readouterr().out
    argv = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=8, zero__path="flat", checkpoint__every=3),
            "--resume", str(ck)]
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert f"checkpoint step {STEPS}" in line and "unreadable" in line and "--resume-fallback" in line
    assert main(argv + ["--resume-fallback"]) == 0
    captured = capsys.readouterr()
    line = one_line(captured.err)
    assert f"checkpoint step {STEPS}" in line and "moved it to" in line and "Traceback" not in captured.err
    assert f"resuming from checkpoint step 3 in {ck}" in captured.out
    assert [r["step"] for r in metrics(tmp_path / "o")] == [4, 5, 6, 7, 8]
    assert [p.name.split("-")[0] for p in (ck / "damaged").iterdir()] == [f"step_{STEPS:08d}"]
    assert saved_steps(ck) == [3, 6, 8]  # step 6 saved again, this time whole
    assert main(["ckpt", "info", "--verify", str(ck)]) == 0


# ---------------------------------------------------------------- failing and stopped runs


def _without_compilation_cache() -> dict:
    """The test session's environment without its JAX compilation cache (conftest.py): under a write
    limit JAX would warn that it cannot write the cache, a line of JAX's beside jzero's one."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


@pytest.mark.slow
def test_a_failed_save_stops_the_run_with_one_line(tmp_path):
    """A write limit (as from a full disk) makes the first save fail: exit 2, one line, no hang."""
    args = ["train", "--out", str(tmp_path / "o"), *TINY, *sets(train__steps=50, checkpoint__dir=tmp_path / "ck",
            checkpoint__every=2)]
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (30000, 30000)); "
    proc = subprocess.run(
        [sys.executable, "-c", limit + "import sys; from jzero.cli import console; sys.argv[0] = 'jzero'; console()",
         *args], capture_output=True, text=True, env=_without_compilation_cache(), timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if "cuda" not in line and "absl::InitializeLog" not in line]
    assert len(err) == 1 and err[0].startswith("jzero: error: saving checkpoint step 2 to "), proc.stderr[-3000:]
    assert saved_steps(tmp_path / "ck") == []
    assert len(metrics(tmp_path / "o")) < 50


# TensorStore's error on ENOSPC (0.1.x, a real full tmpfs): its status is RESOURCE_EXHAUSTED, as XLA's out-of-memory is
TENSORSTORE_ENOSPC = ('RESOURCE_EXHAUSTED: Error writing local file "{dir}/step_00000004.orbax-checkpoint-tmp/state/'
                      'd/0": Failed writing: "{dir}/x.__lock": Failed to write 292339 bytes to file 4: No space left '
                      "on device [os_error_code='28']")


@pytest.mark.parametrize("error", ["tensorstore", "oserror"])
def test_a_full_disk_during_a_save_is_named_not_reported_as_out_of_memory(error, monkeypatch, capsys, tmp_path):
    """Before: "out of memory during step (... RESOURCE_EXHAUSTED ...): shard more ..." for a full disk."""
    import errno

    import orbax.checkpoint as ocp

    ck = tmp_path / "ck"
    real_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step < 4:
            return real_save(self, step, *args, **kwargs)
        if error == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(ck / "step_00000004.orbax-checkpoint-tmp"))
        raise ValueError(TENSORSTORE_ENOSPC.format(dir=ck))

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    argv = ["train", "--out", str(tmp_path / "o"), *TINY,
            *sets(train__steps=STEPS, checkpoint__dir=ck, checkpoint__every=2, checkpoint__async="false")]
    assert main(argv) == 2
    assert one_line(capsys.readouterr().err) == (
        f"jzero: error: no space left (on the device or in the quota) while saving checkpoint step 4 to {ck}: free "
        "space there or lower checkpoint.keep; the steps saved before it are intact"
    )
    assert saved_steps(ck) == [2]


@pytest.mark.slow
def test_sigterm_saves_the_step_exits_143_and_the_same_command_continues(tmp_path):
    """The requeue pattern: a job script that always passes --resume starts fresh the first time."""
    ck, out = tmp_path / "ck", tmp_path / "o"
    args = ["train", "--out", str(out), *TINY, *sets(checkpoint__dir=ck, checkpoint__every=1000), "--resume"]
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", *args, *sets(train__steps=100000)],
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and metrics(out)):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert f"no checkpoint in checkpoint.dir={ck} yet: starting from step 0" in stdout
    last = metrics(out)[-1]["step"]
    assert f"jzero: stopped: SIGTERM: stopped after step {last}; checkpoint step {last} is in" in err
    assert saved_steps(ck) == [last]
    proc = cli(*args, *sets(train__steps=last + 1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in metrics(out)] == list(range(1, last + 2))


@pytest.mark.slow
def test_sigterm_during_a_long_evaluation_saves_the_step_it_follows(tmp_path):
    """The evaluation after step 2 reads thousands of batches, far beyond the grace: a SIGTERM in it (or
    before it) ends it and saves step 2, its row without val_loss. Before, the run evaluated to the end,
    the grace ran out and step 2 was lost (exit 143, the newest checkpoint step 0: none)."""
    ck, out = tmp_path / "ck", tmp_path / "o"
    i = TINY.index("data.kind=synthetic")
    tiny = TINY[: i - 1] + TINY[i + 1 :]  # text data, which has a validation split
    args = ["train", "--out", str(out), *tiny,
            *sets(train__steps=4, train__eval_every=2, train__eval_batches=100000, checkpoint__dir=ck,
                  checkpoint__every=1000)]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", *args], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and metrics(out)):
            time.sleep(0.05)
        time.sleep(1.0)  # step 2, then into its evaluation
        proc.send_signal(signal.SIGTERM)
        t = time.time()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert time.time() - t < GRACE_S
    assert "jzero: stopped: SIGTERM: stopped after step 2; checkpoint step 2 is in" in err, err[-3000:]
    assert saved_steps(ck) == [2]
    assert [r["step"] for r in metrics(out)] == [1, 2] and "val_loss" not in metrics(out)[-1]


def test_a_step_that_is_not_there_is_named_with_the_steps_that_are(tmp_path, capsys):
    """Before, export-megatron --step 5 said "metadata unreadable (ValueError: No step path found ...)"."""
    ck = tmp_path / "ck"
    model = [a for a in TINY if a.startswith("model.")]
    assert main(["train", "--out", str(tmp_path / "o"), *TINY,
                 *sets(train__steps=2, checkpoint__dir=ck, checkpoint__every=2, checkpoint__async="false")]) == 0
    capsys.readouterr()
    argv = ["ckpt", "export-megatron", str(ck), str(tmp_path / "out"), *[a for m in model for a in ("--set", m)],
            "--step", "5"]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err == f"jzero: error: no checkpoint step 5 in {ck.resolve()}: its steps are 2\n"


@pytest.mark.slow
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
        while time.time() < deadline and len(saved_steps(ck)) < 3:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)  # saving every step: the kill lands in or between saves
        proc.wait()
    committed = saved_steps(ck)
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


@pytest.mark.slow
def test_checkpoints_move_between_a_quantized_param_gather_and_the_plain_path(base, tmp_path):
    """fp32 params: a run with zero.param_gather_dtype=int8 keeps fp32 main params, a plain run none.
    Before, neither could resume the other's checkpoint ("main_params/... checkpoint missing")."""
    root, rows = base
    ck = copy_without_last(root / "ck", tmp_path / "ck")
    int8 = train(tmp_path / "a", *sets(zero__path="flat", zero__param_gather_dtype="int8"), "--resume", str(ck))
    # Step 4's forward runs on the restored params, which are the plain run's exactly (main params from them).
    np.testing.assert_allclose(int8[0]["loss"], rows[3]["loss"], rtol=1e-6)
    assert any(n.startswith("main_params/") for n in read_meta(ck, STEPS)["arrays"])
    # Back to the spec path, which keeps no main params: its params are the int8 run's exact main params.
    spec = train(tmp_path / "b", *sets(train__steps=STEPS + 2, zero__path="spec"), "--resume", str(ck))
    assert [r["step"] for r in spec] == [7, 8] and all(np.isfinite(r["loss"]) for r in spec)
