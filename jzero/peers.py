"""Watching the other processes of a multi-process run: a lost one ends the run in one line.

Started by `jzero.runtime.start_jax` once the processes have joined; see `Monitor`. Also the
one-line exit used wherever a hang can only be escaped from a thread (`die`).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

from jzero.config import DistributedConfig
from jzero.errors import one_line

KEY = "jzero"  # jzero's keys in JAX's key-value store (jzero.runtime's too)
_monitor: Monitor | None = None  # this process's, once started
_progress = {"steps": 0, "phase": "start-up"}  # this process's, as the training loop reports it
LOOP_PHASES = ("step", "evaluate", "save")  # once a process is in one, the step clock runs


def progress(steps: int, phase: str) -> None:
    """Reports this process's progress: `steps` completed, now in `phase` ("compile", "step", "evaluate",
    "save", ...). The beat thread publishes it; process 0 stops the run if none completes a step in
    `step_timeout_s`."""
    _progress.update(steps=steps, phase=phase)


def finish(code: int) -> None:
    """Leaves the run (if any) before the interpreter exits with `code`; see `Monitor._leave`."""
    if _monitor is not None:
        _monitor._leave(code)


def leaving(what: str) -> None:
    """Tells the other processes (if any) that this one is about to exit on its own: each stops with
    "process I of N <what>" instead of waiting `heartbeat_timeout_s` to find it lost."""
    if _monitor is not None:
        _monitor.gave_up.set()
        _monitor._mark(f"error:process {_monitor.me} of {_monitor.n} {what}")


class Monitor:
    """Watches the run's other processes; if one is lost, every survivor exits naming it.

    A beat thread publishes this process's heartbeat in JAX's key-value store (a counter: clocks
    differ between hosts) and reads the others': process 0 reads everyone's, the others read
    process 0's (O(N) reads per beat in all), and all read the exit marks, "done" (this process
    is leaving normally) or "error:<reason>" (it gave up). A judge thread decides from what the
    beat thread saw, so a key-value call that hangs (the coordinator stopped) cannot stop it:

    - another process gave up: give up too, with its reason (every process says the same);
    - another process left (after its own error line or traceback) and this one has not finished
      `timeout_s` later, or a collective of this one has failed since: give up, naming it;
    - no answer from the coordinator for `heartbeat_timeout_s`: it is lost;
    - a watched process silent that long, and not leaving: it is lost;
    - this process is leaving and a watched one has still not finished, later than the above
      (so the process still running, which knows more, speaks first);
    - process 0, with `step_timeout_s`: no process has completed a step for that long since the
      steps began (each publishes its `progress`): every process is alive but the run is stuck
      (two in different collectives, one in a host call that never returns); it names the slowest.

    Heartbeats come from a thread, so a process blocked in a long compile or a collective is
    alive; a gap in the judge's own ticks (this process was paused) restarts every clock.
    """

    def __init__(self, client, me: int, n: int, coordinator: str, t: DistributedConfig):
        self.client, self.me, self.n, self.coordinator = client, me, n, coordinator
        self.lost_after, self.leave_within, self.step_within = t.heartbeat_timeout_s, t.timeout_s, t.step_timeout_s
        self.progress: dict[int, dict] = {}  # k -> its published progress (process 0, with step_timeout_s)
        self.step_clock: tuple[int, float] | None = None  # (the most steps any process completed, since when)
        self.interval = min(max(self.lost_after / 6, 0.2), 5.0)
        now = time.monotonic()
        self.beats = {k: (None, now) for k in (range(1, n) if me == 0 else (0,))}  # k -> (counter, when it changed)
        self.exits: dict[int, tuple[str, float]] = {}  # k -> (its exit mark, when first seen)
        self.answered = now  # the coordinator's last answer
        self.left: float | None = None  # when this process began to leave normally
        self.collective_failed = False
        self.gave_up = threading.Event()
        self.stopped = threading.Event()  # set once this process has left JAX's distributed system
        self.threads: list[threading.Thread] = []  # every thread of this monitor that calls the key-value store
        self.lock = threading.Lock()

    def start(self) -> None:
        global _monitor
        _monitor = self
        for fn in (self._beat, self._judge):
            self._thread(fn, f"jzero{fn.__name__}")
        atexit.register(self._leave)  # before JAX's own exit handler (shutdown barrier), registered earlier
        sys.excepthook = self._excepthook(sys.excepthook)

    def _beat(self) -> None:
        count, own = 0, f"{KEY}/beat/{self.me}"
        while not self.stopped.is_set():
            count += 1
            try:
                self.client.key_value_set(own, str(count), allow_overwrite=True)
                if self.step_within:
                    self.client.key_value_set(f"{KEY}/progress/{self.me}", json.dumps(_progress), allow_overwrite=True)
                progress = {}
                if self.me == 0:
                    beats = dict(self.client.key_value_dir_get(f"{KEY}/beat/"))
                    if self.step_within:
                        progress = dict(self.client.key_value_dir_get(f"{KEY}/progress/"))
                else:
                    beats = {f"{KEY}/beat/0": self.client.key_value_try_get(f"{KEY}/beat/0")}
                exits = self.client.key_value_dir_get(f"{KEY}/exit/")
            except Exception:  # no answer: the judge decides when that has gone on too long
                self.stopped.wait(self.interval)
                continue
            now = time.monotonic()
            with self.lock:
                for k, (last, _) in self.beats.items():
                    if beats.get(f"{KEY}/beat/{k}", last) != last:
                        self.beats[k] = (beats[f"{KEY}/beat/{k}"], now)
                for key, mark in exits:
                    k = int(key.rsplit("/", 1)[1])
                    if self.exits.get(k, ("",))[0] != mark:
                        self.exits[k] = (mark, now)
                self.answered = now
                for key, value in progress.items():
                    self.progress[int(key.rsplit("/", 1)[1])] = json.loads(value)
            self.stopped.wait(self.interval)

    def _judge(self) -> None:
        tick = time.monotonic()
        while not self.stopped.wait(self.interval):
            now = time.monotonic()
            with self.lock:
                if now - tick > 3 * self.interval + 1:  # this process was paused, not the others silent
                    self.answered = now
                    self.beats = {k: (v, now) for k, (v, _) in self.beats.items()}
                tick = now
                verdict = self._verdict(now)
            if verdict:
                self._give_up(*verdict)

    def _verdict(self, now: float) -> tuple[str, bool] | None:
        """(why this process must give up now, whether another process said so first), or None."""
        for k, (mark, since) in sorted(self.exits.items()):
            if k == self.me:
                continue
            if mark.startswith("error:"):
                return mark.removeprefix("error:"), True
            if self.left is None and (self.collective_failed or now - since > self.leave_within):
                return f"process {k} of {self.n} left the run before process {self.me} finished", False
        if now - self.answered > self.lost_after:
            if self.left is not None:
                return None  # JAX's shutdown has closed the connection
            return f"lost the coordinator (process 0 at {self.coordinator}): no answer for {self.lost_after} s", False
        if (stuck := self._stuck(now)) is not None:
            return stuck, False
        for k, (_, changed) in self.beats.items():
            if k in self.exits:
                continue
            if now - changed > self.lost_after:
                return f"process {k} of {self.n} stopped responding", False
            if self.left is not None and now - self.left > self.leave_within + 3 * self.interval + 2:
                # Late: a process that is still running gives up first, with the better reason.
                return f"process {k} of {self.n} did not finish within {self.leave_within} s of this one", False
        return None

    def _stuck(self, now: float) -> str | None:
        """Process 0's step clock: why the run is stuck, or None (module docstring of `Monitor`)."""
        if not self.step_within or self.left is not None or not self.progress:
            return None
        top = max(p["steps"] for p in self.progress.values())
        if self.step_clock is None:
            if any(p["phase"] in LOOP_PHASES for p in self.progress.values()):
                self.step_clock = (top, now)
            return None
        if top != self.step_clock[0]:
            self.step_clock = (top, now)
            return None
        if now - self.step_clock[1] <= self.step_within:
            return None
        k, p = min(self.progress.items(), key=lambda kp: (kp[1]["steps"], kp[0] == 0))  # a tie: not the coordinator
        return (
            f"no process completed a step in {self.step_within} s (distributed.step_timeout_s); the slowest, "
            f"process {k} of {self.n}, has completed {p['steps']} and is in {p['phase']}"
        )

    def _give_up(self, reason: str, adopted: bool) -> None:
        self.gave_up.set()
        if not (adopted and self.left is not None):  # a process leaving has reported (or succeeded) already
            say(f"{reason}; exiting")
        self._mark(f"error:{reason}")
        if self.me == 0:  # the coordinator goes with this process, and JAX would abort the others: wait for them
            end = time.monotonic() + 4 * self.interval + 2
            while time.monotonic() < end:
                with self.lock:
                    now = time.monotonic()
                    if all(now - t > 2 * self.interval for _, t in self.beats.values()):
                        break
                time.sleep(self.interval / 4)
        os._exit(2)

    def _mark(self, mark: str) -> None:
        """Publishes this process's exit mark; waits at most a second (the coordinator may be gone)."""

        def publish():
            try:
                self.client.key_value_set(f"{KEY}/exit/{self.me}", mark, allow_overwrite=True)
            except Exception:
                pass

        try:
            self._thread(publish, "jzero_mark").join(1.0)
        except RuntimeError:  # at exit Python 3.12+ starts no thread: from this one, as JAX's shutdown next calls
            publish()

    def _thread(self, fn, name: str) -> threading.Thread:
        thread = threading.Thread(target=fn, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def _leave(self, code: int | None = None) -> None:
        """Leaves the run: the "done" mark, JAX's shutdown barrier (watched by the judge), then
        this monitor's threads stopped, each within a bound. Run by `finish` or at exit.

        Python (before 3.14) ends a daemon thread that returns from C++ while the interpreter
        finalizes by unwinding it, and nanobind's frames turn that unwinding into an abort
        ("FATAL: exception not rethrown"). So no thread of this monitor may be inside a key-value
        call by then: JAX's shutdown cancels the calls in flight, and the threads are joined. One
        still alive after its bound leaves the process at once with `code` (when known).
        """
        if self.gave_up.is_set() or self.stopped.is_set():
            return
        with self.lock:
            self.left = time.monotonic()
        self._mark("done")
        import jax

        try:
            jax.distributed.shutdown()  # what JAX's own exit handler does next; a no-op there after this
        except Exception as e:  # its barrier failed: a peer is gone (the judge may have said which already)
            say(f"leaving the run: {one_line(e)}")
        self.stopped.set()
        end = time.monotonic() + self.interval + 2
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        if code is not None and any(t.is_alive() for t in self.threads):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _excepthook(self, previous):
        """A JAX runtime error in the main thread (a collective whose peer is gone) waits for the
        judge: if a process is lost, its one line replaces the traceback."""

        def hook(kind, value, tb):
            import jax

            if issubclass(kind, jax.errors.JaxRuntimeError):
                with self.lock:
                    self.collective_failed, since = True, time.monotonic()
                end = since + self.lost_after + 3 * self.interval + 1
                while time.monotonic() < end and not self.gave_up.wait(self.interval):
                    with self.lock:  # every watched process beat since: none is lost, so no line is coming
                        others_left = any(k != self.me for k in self.exits)
                        if all(t > since + self.interval for _, t in self.beats.values()) and not others_left:
                            break
                if self.gave_up.is_set():
                    time.sleep(4 * self.interval + 5)  # the judge is ending the process
            previous(kind, value, tb)

        return hook


def say(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"jzero: error: {message}\n")  # one write: `jzero launch` interleaves whole lines
    sys.stderr.flush()


def die(message: str) -> None:
    """One line, then exit 2 at once: from a watchdog thread, past a hang in C++."""
    say(message)
    os._exit(2)
