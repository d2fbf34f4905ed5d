"""`jzero launch --local N [train args]`: one multi-process run of N `jzero train` processes here.

For trying multi-process training on one machine: process i runs `python -m jzero.cli train
[train args] --coordinator 127.0.0.1:<free port> --num-processes N --process-id i` on the CPU
(JAX_PLATFORMS=cpu unless set), with `train.host_devices` simulated devices each, so the mesh
spans N x host_devices devices. Process 0's stdout and stderr pass through (its progress bar and
summary); the others' stderr lines come prefixed `[process i] `, and their stdout is dropped
(only process 0 reports).

N is at most `max_local()`, 4 per CPU (at least 8). SIGINT and SIGTERM are forwarded to every
process (a second SIGINT kills them); one that comes, or a process that fails, while they are being
started stops the starting. When a process fails, the others get `GRACE_S` to end by themselves
(each says in one line what it saw), after a forwarded signal `SIGNAL_GRACE_S`; then SIGTERM, then
SIGKILL. The launcher's last line names the process that failed first, and its exit code is that
process's (2 for a jzero error, 128 + S for signal S). Every wait is bounded, and no process outlives
the launcher (Linux).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from jzero.errors import ConfigError

GRACE_S = 10.0  # after a failure, for the other processes to end by themselves (and say why)
SIGNAL_GRACE_S = 60.0  # after a forwarded signal (SIGTERM: each finishes its step and saves it)
TERM_S = 5.0  # after SIGTERM, before SIGKILL
_POLL_S = 0.1
_SET_BY_LAUNCH = ("coordinator", "num_processes", "process_id", "distributed")


def add_parser(sub, train: argparse.ArgumentParser, check_train: Callable[[argparse.Namespace], object]) -> None:
    """Adds `jzero launch` to the CLI's subparsers; `train` is `jzero train`'s parser, `check_train` its checks
    of the parsed arguments before JAX starts (`jzero.cli.check_train_args`)."""
    p = sub.add_parser(
        "launch", help="N local `jzero train` processes as one multi-process run (CPU)",
        usage="jzero launch --local N [CONFIG] [jzero train options]",
        description="Starts N processes of `jzero train` on this machine as one run; train.host_devices "
        "is the simulated CPU devices of each (docs/cluster.md).",
    )
    p.add_argument(
        "--local", nargs=argparse.REMAINDER, required=True, metavar="N [TRAIN_ARGS]",
        help="the number of processes, then `jzero train`'s config and options",
    )
    p.set_defaults(fn=functools.partial(_cmd_launch, train=train, check_train=check_train))


def cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container's limits set), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def max_local() -> int:
    """The most processes `--local` starts: 4 per CPU this process may run on, at least 8."""
    return max(8, 4 * cpus())


def _cmd_launch(args, train: argparse.ArgumentParser, check_train) -> int:
    n = args.local[0] if args.local else ""
    if not (n.isascii() and n.isdigit()) or int(n) < 1:  # '²' is a digit int() refuses
        raise ConfigError(f"--local N needs a number of processes >= 1 first, got {n!r}")
    if int(n) > max_local():
        raise ConfigError(
            f"--local {int(n)}: at most {max_local()} processes on this machine ({cpus()} CPUs, 4 each); "
            "for more, run them on more hosts (docs/cluster.md)"
        )
    train_args = args.local[1:]
    parsed = train.parse_args(train_args)  # a bad option: one line and exit 2, once
    given = [name for name in _SET_BY_LAUNCH if (v := getattr(parsed, name)) is not None and v is not False]  # 0 too
    if given:
        raise ConfigError(
            f"jzero launch gives each process --coordinator, --num-processes and --process-id: "
            f"drop --{given[0].replace('_', '-')}"
        )
    check_train(parsed)  # a bad config or --out: one line here, not one per process
    return run_local(int(n), train_args)


def run_local(n: int, train_args: list[str], grace_s: float = GRACE_S) -> int:
    """Runs `jzero train train_args` as processes 0 .. n-1 of one run; returns the exit code."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")  # on a GPU host every process would take every GPU
    procs, readers, signals = [], [], []
    told = [0]  # processes the first forwarded signal reached (one forked as it came is told after the loop)

    def forward(signum, frame):
        again = signum == signal.SIGINT and signal.SIGINT in signals
        if not signals:
            told[0] = len(procs)
        signals.append(signum)
        _send(procs, signal.SIGKILL if again else signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(n):
            if signals or any(p.poll() not in (None, 0) for p in procs):
                break  # a signal, or a process failed, while starting them: start no more
            quiet = i > 0
            cmd = [sys.executable, "-m", "jzero.cli", "train", *train_args, "--coordinator", coordinator,
                   "--num-processes", str(n), "--process-id", str(i)]
            procs.append(subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE if quiet else None,
                start_new_session=True,  # the terminal's Ctrl-C reaches the launcher only, which forwards it once
                preexec_fn=_end_with_launcher(),
            ))
        if signals:  # once each: a second SIGTERM would abandon a process's save
            _send(procs[told[0]:], signals[0])
        for i, p in enumerate(procs[1:], start=1):  # threads only after the last fork
            readers.append(threading.Thread(target=_prefix, args=(p.stderr, f"[process {i}] "), daemon=True))
            readers[-1].start()
        failed = _supervise(procs, grace_s, signals)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:  # the launcher itself failed: leave nothing behind
                p.kill()
    for r in readers:
        r.join(1.0)
    if signals:
        print("jzero: interrupted" if signals[0] == signal.SIGINT else "jzero: stopped: SIGTERM", file=sys.stderr)
        return 128 + signals[0]
    if failed is not None:
        i, code = failed
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"jzero: error: process {i} of {n} {how}; the run stopped", file=sys.stderr)
        return 128 - code if code < 0 else code
    return 0


def _supervise(procs: list[subprocess.Popen], grace_s: float, signals: list[int]) -> tuple[int, int] | None:
    """Waits for every process, stopping the rest after a failure or a signal (`signals`: those the
    launcher's handler forwarded, appended as they come).

    Returns (process, exit code) of the first to fail, or None.
    """
    failed, stop_at, escalated = None, None, -1
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if failed is None and code not in (None, 0):
                failed = (i, code)
        if all(code is not None for code in codes):
            break
        now = time.monotonic()
        if stop_at is None and (failed or signals):
            stop_at = now + (grace_s if failed else SIGNAL_GRACE_S)
        if stop_at is not None and now > stop_at:
            step = min(int((now - stop_at) // TERM_S), 2)  # 0: SIGTERM, 1: SIGKILL, 2: give up
            if step == 2:  # unkillable (a process in uninterruptible I/O): stop waiting
                break
            if step == escalated + 1:
                escalated = step
                _send(procs, (signal.SIGTERM, signal.SIGKILL)[step])
        time.sleep(_POLL_S)
    return failed


def _send(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass


def _end_with_launcher():
    """For the child, between fork and exec: SIGTERM when the launcher dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG), so no process outlives it. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    launcher = os.getpid()

    def in_child():
        prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before the line above: nothing would tell us
            os._exit(143)

    return in_child


def _prefix(stream, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        sys.stderr.write(prefix + text + ("" if text.endswith("\n") else "\n"))
        sys.stderr.flush()
    stream.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
