"""Multi-process runs over 127.0.0.1: `jzero launch --local 2` trains like one process with all the
devices, and every way a run can go wrong ends within its bound, each process with one line."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import stderr_lines
from jzero.cli import main

TINY = ["--set", "model.n_layers=1", "--set", "model.seq_len=16", "--set", "model.d_model=32", "--set", "model.d_ff=64",
        "--set", "data.kind=synthetic", "--set", "train.global_batch=16", "--quiet"]
TIMEOUT_S, HEARTBEAT_S = 6, 4  # distributed.*: small, so every failure below ends in seconds
FAST = ["--set", f"distributed.timeout_s={TIMEOUT_S}", "--set", f"distributed.heartbeat_timeout_s={HEARTBEAT_S}",
        "--set", "train.host_devices=4"]
STARTUP_S = 60  # importing JAX and compiling, 2-4 processes on 2 cores, before any bound starts
IMPORT_S = 20  # starting Python and importing JAX, before the join's bound starts
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jzero(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jzero.cli", *args], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _train(port: int, n: int, me: int, out: Path, *extra: str) -> subprocess.Popen:
    return _jzero("train", "--out", str(out), *TINY, *FAST, *extra,
                  "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(me))


def _ends(procs: list[subprocess.Popen], within: float) -> list[tuple[int, str, float]]:
    """(exit code, stderr, seconds) of each process, all waited for at most `within` seconds."""
    t0, results = time.monotonic(), []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(0.1, within - (time.monotonic() - t0)))
            results.append((p.returncode, err, time.monotonic() - t0))
    finally:
        for p in procs:
            p.kill()
    return results


def _lines(stderr: str) -> list[str]:
    return stderr_lines(stderr)


def _one_line(stderr: str) -> str:
    lines = _lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("jzero: error: "), stderr[-3000:]
    return lines[0].removeprefix("jzero: error: ")


def zero2_on(path: str) -> list[str]:
    """ZeRO-2 on `path`, dp 4 x tp 2: on 2 processes x 4 CPU devices the dp groups span both processes."""
    return ["--set", "zero.strategy=optim_grads", "--set", f"zero.path={path}", "--set", "mesh.dp=4",
            "--set", "mesh.tp=2"]


# DDP under HSDP, dp_outer 2 x dp 2 x tp 2: its hierarchical all-reduce (spec path) runs across dp_outer,
# between the processes, and inside dp, within each.
DDP_HSDP = ["--set", "zero.strategy=no_shard", "--set", "mesh.dp_outer=2", "--set", "mesh.dp=2", "--set", "mesh.tp=2"]


# Megatron's Muon on the owned layout, dp 8: the owners of whole params on both processes, the reduce-scatter to
# them and the all-gather of their segments across the processes.
# Muon's Newton-Schulz in fp32: the two layouts' losses differ in the last bit (the mean over ranks is summed in
# another order across processes) and Megatron's bf16 Newton-Schulz turns that into grad norms ~1e-5 apart by step
# 5 (jax 0.12.0.1: 1.06e-5; bf16: 3.7e-7, 5.2e-6, 9.9e-6 at steps 3-5; fp32: equal at every step).
OWNED_MUON = ["--set", "zero.strategy=optim", "--set", "zero.path=owned", "--set", "optimizer.name=muon",
              "--set", "mesh.dp=8", "--set", "optimizer.muon.ns_dtype=float32"]  # fmt: skip


@pytest.mark.parametrize(  # spec ZeRO-2: test_a_checkpoint_moves_from_two_processes_to_one_and_back
    "sets", [zero2_on("flat"), DDP_HSDP, OWNED_MUON], ids=["zero2-flat", "ddp-hsdp-spec", "muon-owned"]
)
@pytest.mark.slow
def test_launch_two_processes_train_like_one(sets, tmp_path):
    """2 processes x 4 CPU devices (DP across the processes) = 1 process x 8 devices: ZeRO-2 on dp 4 x
    tp 2, and DDP under HSDP."""
    sets = [*sets, "--set", "train.steps=5"]
    assert main(["train", "--out", str(tmp_path / "single"), *TINY, *sets]) == 0
    single = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]

    launch = _jzero("launch", "--local", "2", "--out", str(tmp_path / "multi"), *TINY, *sets,
                    "--set", "train.host_devices=4")
    out, err = launch.communicate(timeout=300)
    assert launch.returncode == 0, err[-3000:]
    assert "per-device memory" in out  # process 0's report passes through
    # Nothing else on stderr: on Python 3.12 each process printed a traceback as it left (its exit
    # mark's thread could not start at exit) before the CLI left the run before exiting (peers.finish).
    assert not [line for line in _lines(err) if "[Gloo]" not in line], err[-3000:]
    multi = [json.loads(x) for x in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    assert len(multi) == len(single) == 5
    np.testing.assert_allclose([m["loss"] for m in multi], [s["loss"] for s in single], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in multi], [s["grad_norm"] for s in single], rtol=1e-5)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--num-processes", "2"], "--num-processes without --coordinator and --process-id"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2"], "without --process-id"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "--process-id 2 must be in"),
        (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
        (["--distributed", "--process-id", "0"], "--distributed takes the run's layout from the cluster"),
        (["--distributed"], "--distributed: JAX detected no cluster"),
    ],
)
def test_incomplete_multiprocess_flags_are_one_line(flags, needle, tmp_path, capsys):
    """Before, --num-processes alone trained one process as if nothing had been asked."""
    assert main(["train", "--out", str(tmp_path), *TINY, *flags]) == 2
    assert needle in _one_line(capsys.readouterr().err)


def _started_with(tmp_path, counts_and_ids) -> list[tuple[int, str, float]]:
    port = _free_port()
    return _ends([_train(port, n, me, tmp_path) for n, me in counts_and_ids], STARTUP_S + TIMEOUT_S + 10)


@pytest.mark.slow
def test_a_process_count_that_differs_stops_every_process_at_once(tmp_path):
    """Process 1 says 3 processes, the coordinator 2: JAX itself would run on without noticing."""
    for code, err, _ in _started_with(tmp_path, [(2, 0), (3, 1)]):
        assert code == 2
        assert _one_line(err) == ("process 0 and process 1 were started with different --num-processes (2 and 3): "
                                  "every process must be given the same")


@pytest.mark.parametrize("case", ["coordinator_expects_more", "duplicate_process_id"])
@pytest.mark.slow
def test_a_run_that_cannot_form_ends_within_the_timeout(case, tmp_path):
    """Before, each hung for JAX's 5 minutes, then aborted in C++."""
    counts_and_ids = {"coordinator_expects_more": [(3, 0), (2, 1)], "duplicate_process_id": [(2, 1), (2, 1)]}[case]
    for (n, me), (code, err, seconds) in zip(counts_and_ids, _started_with(tmp_path, counts_and_ids)):
        assert code == 2, err[-3000:]
        line = _one_line(err)
        assert line.startswith("could not join the run at 127.0.0.1:")
        assert f"within {TIMEOUT_S} s as process {me} of {n}: not every process joined" in line
        assert seconds < IMPORT_S + TIMEOUT_S + 5  # process 0 waits 5 s more, so the others report first


@pytest.mark.slow
def test_distributed_takes_the_layout_from_slurm_and_is_bounded_too(tmp_path):
    """--distributed as `srun` would start process 1 of 2, with no process 0: JAX's SLURM detection
    names the run, and the join ends within the timeout like a run started by hand."""
    port = _free_port()
    slurm = dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_PROCID="1",
                 SLURM_LOCALID="1", JAX_COORDINATOR_PORT=str(port))
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", "train", "--distributed", "--out", str(tmp_path),
                             *TINY, *FAST], env=dict(ENV, **slurm), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ((code, err, seconds),) = _ends([proc], IMPORT_S + TIMEOUT_S + 5)
    assert code == 2
    line = _one_line(err)
    assert line.startswith(f"could not join the run at localhost:{port} within {TIMEOUT_S} s as process 1 of 2")
    assert seconds < IMPORT_S + TIMEOUT_S


def test_a_coordinator_port_in_use_is_reported_at_once(tmp_path):
    """Before, process 0 segfaulted (a listening socket) or shared the port with the other run (gRPC)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ((code, err, seconds),) = _ends([_train(port, 2, 0, tmp_path)], STARTUP_S)
    assert code == 2 and _one_line(err).startswith(f"the coordinator port {port} is already in use on this host")
    assert seconds < IMPORT_S


LEAVES = """
import atexit, sys, threading

# Registered before JAX is imported, so it runs after JAX's exit handler, as the interpreter finalizes.
atexit.register(lambda: print(*(t.name for t in threading.enumerate() if t.name.startswith("jzero"))))

import jax
from jax._src import distributed
from jzero import peers
from jzero.config import DistributedConfig

jax.distributed.initialize(sys.argv[1], num_processes=1, process_id=0)
peers.Monitor(distributed.global_state.client, 0, 1, sys.argv[1], DistributedConfig()).start()
"""


def test_no_monitor_thread_outlives_the_exit_handlers():
    """Python ends a daemon thread that returns from C++ while it finalizes by unwinding it, and
    nanobind aborts on that ("FATAL: exception not rethrown", SIGABRT): once in CI, a process of a
    two-process run whose beat thread was in a key-value call to process 0 (gone) as it exited."""
    script = subprocess.run([sys.executable, "-c", LEAVES, f"127.0.0.1:{_free_port()}"], env=ENV, text=True,
                            capture_output=True, timeout=STARTUP_S)
    assert script.returncode == 0 and not _lines(script.stderr), script.stderr[-3000:]
    assert script.stdout == "\n"  # no thread named jzero*


def _wait_for_steps(out: Path, steps: int, procs: list[subprocess.Popen]) -> None:
    """Until `out` holds `steps` steps' metrics; if none come within the bound, or a process ends, the
    processes are killed (a failed test leaves nothing running: a stuck pair once outlived its test)."""
    t0 = time.monotonic()
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        if time.monotonic() - t0 > 2 * STARTUP_S or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError(f"no {steps} steps: " + "; ".join(f"exit {p.wait()}" for p in procs))
        time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_process_ends_the_other_with_one_line(tmp_path):
    """Before, the survivor lived ~90 s more (JAX's heartbeat timeout), then aborted in C++."""
    port = _free_port()
    procs = [_train(port, 2, me, tmp_path, "--set", "train.steps=100000") for me in (0, 1)]
    _wait_for_steps(tmp_path, 2, procs)
    procs[1].send_signal(signal.SIGKILL)
    (code, err, seconds), _ = _ends(procs, HEARTBEAT_S + 20)
    assert code == 2 and _one_line(err) == "process 1 of 2 stopped responding; exiting"
    assert seconds < HEARTBEAT_S + 5


@pytest.mark.slow
def test_launch_names_the_process_that_died(tmp_path):
    launch = _jzero("launch", "--local", "2", "--out", str(tmp_path), *TINY, *FAST, "--set", "train.steps=2000")
    children = []
    try:
        _wait_for_steps(tmp_path, 2, [launch])
        children = [int(pid) for pid in Path(f"/proc/{launch.pid}/task/{launch.pid}/children").read_text().split()]
        for pid in children:
            args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if args[args.index("--process-id") + 1] == "1":
                os.kill(pid, signal.SIGKILL)
        ((code, err, seconds),) = _ends([launch], HEARTBEAT_S + 30)
    finally:
        for pid in [launch.pid, *children]:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    lines = _lines(err)
    assert code == 128 + signal.SIGKILL, err[-3000:]
    assert lines[-1] == "jzero: error: process 1 of 2 was killed by SIGKILL; the run stopped"
    assert "jzero: error: process 1 of 2 stopped responding; exiting" in lines  # process 0's own line
    assert seconds < HEARTBEAT_S + 5


@pytest.mark.slow
def test_a_checkpoint_moves_from_two_processes_to_one_and_back(tmp_path):
    """ZeRO-2 on 2 x 4 devices (spec path, dp 4 x tp 2, across processes) saves steps 1-2, one process
    with 8 resumes to 4, two again to 6: every step's loss and grad norm is the uninterrupted
    single-process run's, so the two-process steps (1-2, 5-6) also train like one process (the spec
    case of test_launch_two_processes_train_like_one)."""
    ck = ["--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", "checkpoint.every=2", *zero2_on("spec")]
    assert main(["train", "--out", str(tmp_path / "ref"), *TINY, *zero2_on("spec"), "--set", "train.steps=6"]) == 0
    launch = _jzero("launch", "--local", "2", "--out", str(tmp_path / "a"), *TINY, *FAST, *ck, "--set", "train.steps=2")
    out, err = launch.communicate(timeout=300)
    assert launch.returncode == 0, err[-3000:]
    assert "per-device memory" in out  # process 0's report passes through
    assert main(["train", "--out", str(tmp_path / "b"), *TINY, *ck, "--set", "train.steps=4", "--resume"]) == 0
    launch = _jzero("launch", "--local", "2", "--out", str(tmp_path / "c"), *TINY, *FAST, *ck, "--set", "train.steps=6",
                    "--resume")
    _, err = launch.communicate(timeout=300)
    assert launch.returncode == 0, err[-3000:]
    rows = [json.loads(line) for part in "abc" for line in (tmp_path / part / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref], rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == [f"step_{s:08d}" for s in (2, 4, 6)]


@pytest.mark.slow
def test_processes_alive_but_stuck_stop_at_the_step_timeout(tmp_path):
    """Progress, not only liveness: process 1 hangs in a host call inside its third step and process 0
    waits in that step's collective; both keep heartbeating. Before, nothing bounded this."""
    step_s, port = 5, _free_port()
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])]))
    procs = [subprocess.Popen([sys.executable, "-m", "jzero.cli", "train", "--out", str(tmp_path), *TINY, *FAST,
                               "--set", "model.impl=helpers.stuck_model:StuckModel", "--set", "train.steps=1000",
                               "--set", f"distributed.step_timeout_s={step_s}", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(me)],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for me in (0, 1)]
    _wait_for_steps(tmp_path, 2, procs)
    for code, err, seconds in _ends(procs, step_s + 30):
        assert code == 2, err[-3000:]
        assert _one_line(err) == (f"no process completed a step in {step_s} s (distributed.step_timeout_s); the "
                                  "slowest, process 1 of 2, has completed 2 and is in step; exiting")
        assert seconds < step_s + 10


@pytest.mark.slow
def test_a_killed_process_0_ends_the_other_with_one_line(tmp_path):
    """JAX ends the others at once from C++ (SIGABRT); before, with a 16-line abort stack."""
    port = _free_port()
    procs = [_train(port, 2, me, tmp_path, "--set", "train.steps=100000") for me in (0, 1)]
    _wait_for_steps(tmp_path, 2, procs)
    procs[0].send_signal(signal.SIGKILL)
    _, (code, err, seconds) = _ends(procs, 20)
    assert code == -signal.SIGABRT
    assert _one_line(err) == (f"lost the coordinator (process 0 at 127.0.0.1:{port}): it died, and JAX ends the "
                              "other processes with it")
    assert seconds < 5


@pytest.mark.slow
def test_sigterm_to_one_process_before_the_first_step_stops_both_at_once(tmp_path):
    """Process 1 is told SIGTERM while the run compiles (24 unscanned blocks: seconds of compile): it
    exits 143 at once, and process 0 stops with its reason (the exit mark it leaves), not as a lost process."""
    port = _free_port()
    slow = ["--set", "model.n_layers=24", "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set",
            "model.seq_len=16", "--set", "data.kind=synthetic", "--set", "train.global_batch=16", *FAST]
    procs = [_jzero("train", "--out", str(tmp_path), *slow, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                    "2", "--process-id", str(me)) for me in (0, 1)]
    while (line := procs[0].stdout.readline()) != "compiling the train step\n":  # after gloo's lines
        assert line, "process 0 ended before compiling"
    procs[1].send_signal(signal.SIGTERM)
    (code0, err0, seconds0), (code1, err1, _) = _ends(procs, 30)
    lines1 = _lines(err1)
    assert code1 == 143 and len(lines1) == 1, err1[-3000:]
    assert re.fullmatch(r"jzero: stopped: SIGTERM during (start-up|compile): no step taken, so none to save; "
                        r"exiting", lines1[0])
    why = lines1[0].removeprefix("jzero: stopped: ").removesuffix("; exiting")
    assert code0 == 2 and _one_line(err0) == f"process 1 of 2 was stopped ({why}); exiting"
    assert seconds0 < 10
