"""SIGTERM, a scheduler's preemption notice: a run stops within seconds, whatever it is doing.

A cluster sends SIGTERM and kills soon after (SLURM's KillWait and Kubernetes' grace period are
30 s by default). Python runs a signal handler only between the main thread's bytecodes, and a
compile, a step or a collective runs in C++ for minutes; so the handler's wake-up byte
(`signal.set_wakeup_fd`) also reaches a watcher thread, which acts whatever the main thread does.
What happens depends on the run's `phase`, which the training loop sets:

- "step" (the steps, their saves, the summary): today's behaviour. The loop finishes the step the
  signal arrived in, saves it and raises `Preempted` (exit 143). The watcher only bounds that: if
  the process is still alive `GRACE_S` later, it ends it with one line (the newest complete
  checkpoint is intact: orbax commits a step atomically).
- any other ("start-up", "restore", "compile"): no step has been taken, so there is none to save:
  one line and exit 143 at once. A multi-process run's other processes are told (`peers.leaving`)
  and stop with the same reason.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from jzero import peers

GRACE_S = 8.0  # a step in flight, its save and the exit, after SIGTERM: well inside a 10 s kill window
EXIT_CODE = 128 + signal.SIGTERM  # 143, as a process killed by SIGTERM reports itself to a shell


class Preemption:
    """Watches for SIGTERM while a run is in its `with` block; see the module docstring.

    The handler is installed only from the main thread (Python's rule); elsewhere nothing is
    watched. A second SIGTERM gets the previous handler back (by default: terminate at once).
    With many processes, any one's SIGTERM during the steps stops all of them after the same step
    (`requested`).
    """

    def __init__(self) -> None:
        self.phase = "start-up"
        self.signalled_at: float | None = None
        self.stopped_at: int | None = None  # the step the loop stopped after, once it has
        self._previous = None
        self._closed = False

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="jzero-sigterm-watcher", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, self._previous)
        self._closed = True
        if self.signalled_at is None:
            self._write.close()  # the watcher's recv returns: it ends
        # else the watcher stays, so the exit (JAX's shutdown, a save in flight) is bounded too

    def reinstall(self) -> None:
        """Takes SIGTERM back after `jax.distributed.initialize`, whose preemption notifier installs its
        own handler (which only logs "SIGTERM caught")."""
        if self._previous is not None and self.signalled_at is None:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self._mark()
        signal.signal(signal.SIGTERM, self._previous)

    def _mark(self) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def requested(self) -> bool:
        """Whether any process has been sent SIGTERM (a collective with many: call it on all, in step)."""
        from jzero import multihost

        return multihost.any_process(self.signalled_at is not None)

    def _watch(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:  # __exit__ closed the other end: no SIGTERM came
                self._read.close()
                return
            if signal.SIGTERM in data:
                break
        self._mark()
        if self.phase != "step":
            _exit(f"SIGTERM during {self.phase}: no step taken, so none to save", report=not self._closed)
        end = self.signalled_at + GRACE_S
        while time.monotonic() < end:
            time.sleep(0.1)
        # Still here: the step, its save or the exit did not end in time (the CLI has reported if it closed us).
        why = "the step in flight and its save did not finish" if self.stopped_at is None else "the exit did not finish"
        _exit(f"SIGTERM: {why} within {GRACE_S:.0f} s; the newest complete checkpoint is kept", report=not self._closed)


def _exit(message: str, report: bool) -> None:
    """One line (unless the run has reported already), the other processes told, then exit 143 at once."""
    if report:
        sys.stdout.flush()
        sys.stderr.write(f"jzero: stopped: {message}; exiting\n")
        sys.stderr.flush()
        peers.leaving(f"was stopped ({message})")
    os._exit(EXIT_CODE)
