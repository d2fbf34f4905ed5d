"""The checkpoint directory a run owns: an owner marker, a writer lock, and jzero's step names.

    checkpoint.dir/
      jzero-checkpoints.json  the owner marker: format, when it was created, every run that wrote here
      jzero.lock              locked (flock) by the writing run's process 0 while it runs
      step_00000006/          one saved step (orbax: state/ and meta/ items); a step counts only if
                              its meta item says it is jzero's, never because a folder name is a number,
                              and never through a symlink (jzero writes none; deleting it would reach
                              the folder it points at)
      damaged/                steps found damaged, moved aside so the same step can be saved again
      deleting/               steps `checkpoint.keep` drops: renamed here in one step (orbax's
                              `todelete_subdir`), then deleted (`purge_deleting`); a kill while a
                              step is deleted leaves its remains here, never a half step among the
                              steps, and the next run that writes here finishes deleting them

jzero writes only into a directory that is new, empty, or marked as its own; a marked directory
that already holds steps is continued only with `--resume`; nothing it did not write is ever
deleted or skipped. The lock is advisory (`fcntl.flock`): it holds on local disks and on shared
filesystems mounted with flock support (Lustre `-o flock`, NFSv4).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import orbax.checkpoint as ocp

from jzero.errors import CheckpointError
from jzero.paths import first_special, not_a_file

FORMAT = "jzero.checkpoint/1"
MARKER = "jzero-checkpoints.json"
LOCK = "jzero.lock"
DAMAGED = "damaged"
DELETING = "deleting"
_STEP_FORMAT = ocp.step.standard_name_format(step_prefix="step", step_format_fixed_length=8)


def is_step(path: Path) -> bool:
    """Whether the committed step folder `path` is jzero's: its meta item carries jzero's format, or it
    has jzero's two items (state/, and a meta/ that is unreadable, not a folder, or JSON with no format):
    a damaged step, which restoring reports (never a step to skip silently); meta of another format is
    another tool's, never counted, moved or deleted. A symlink is never jzero's
    step: jzero writes none, and `checkpoint.keep`'s clean-up would delete what it points at. Nor is
    a folder holding a FIFO, socket or device beside its items: orbax reads a step's files as it lists
    it (`_CHECKPOINT_METADATA`), and a FIFO would block that read forever."""
    path = Path(path)
    if path.is_symlink():
        return False
    try:
        if first_special(path) is not None:
            return False
    except OSError:
        return False
    damaged = (path / "meta").exists() and (path / "state").is_dir()
    try:
        if not (path / "meta" / "metadata").is_file():  # a FIFO would block the read forever
            raise OSError("not a regular file")
        meta = json.loads((path / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return damaged
    if isinstance(meta, dict) and meta.get("format") is not None:  # a format: jzero's, or another tool's
        return meta["format"] == FORMAT
    return damaged


class StepNames(ocp.step.NameFormat):
    """orbax's step naming (`step_00000006`) that lists only the steps jzero wrote (`is_step`).

    orbax's CheckpointManager takes its step list from here, so its `max_to_keep` clean-up
    never deletes a folder jzero did not write. Such a folder is also invisible to orbax's
    "is this step saved already" check, so before saving a step the Checkpointer refuses to
    replace one (`foreign_step`).
    """

    def build_name(self, step: int) -> str:
        return _STEP_FORMAT.build_name(step)

    def find_all(self, base_path):
        return (m for m in _STEP_FORMAT.find_all(base_path) if is_step(m.path))

    def find_step(self, base_path, step: int):
        found = _STEP_FORMAT.find_step(base_path, step)
        if not is_step(found.path):
            raise ValueError(f"no jzero checkpoint step {step} in {base_path}")
        return found


def foreign_step(directory: Path, step: int) -> Path | None:
    """The folder that saving `step` would replace, if jzero did not write it."""
    path = directory / StepNames().build_name(step)
    return path if path.exists() and not is_step(path) else None


def read_marker(directory: Path) -> dict | None:
    """The owner marker of `directory`; None if it has none."""
    path = directory / MARKER
    if not path.exists():
        return None
    if not path.is_file():  # a FIFO would block the read forever
        raise CheckpointError(f"checkpoint directory {directory}: {MARKER} is not a regular file")
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint directory {directory}: {MARKER} is unreadable ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("runs"), list):
        raise CheckpointError(f"checkpoint directory {directory}: {MARKER} is not jzero's marker (edited?)")
    if not all(isinstance(r, dict) and isinstance(r.get("started"), str) and isinstance(r.get("host"), str)
               for r in marker["runs"]):  # fmt: skip
        raise CheckpointError(
            f"checkpoint directory {directory}: {MARKER} is damaged (a run entry without "
            "its started time or host): restore it or use a new checkpoint.dir"
        )
    return marker


def steps(directory: Path) -> list[int]:
    """jzero's committed steps in `directory`, oldest first."""
    return sorted(m.step for m in StepNames().find_all(directory))


def open_for_reading(directory: str | Path) -> Path:
    """`directory` resolved, if it is a jzero checkpoint directory (has the owner marker)."""
    directory = Path(directory)
    resolved(directory, "checkpoint directory")  # a backslash in it, as it resolves, is refused
    if not directory.is_dir():
        what = "does not exist"
        if directory.exists():
            special = "is not a directory (a FIFO, socket or device)"
            what = "is a file, not a directory" if directory.is_file() else special
        raise CheckpointError(f"checkpoint directory {directory} {what}")
    if read_marker(directory) is None:
        raise CheckpointError(
            f"{directory} is not a jzero checkpoint directory (it has no {MARKER}; jzero writes one into "
            "every checkpoint.dir it creates)"
        )
    return directory.resolve()


class Claim:
    """This run's hold on a checkpoint directory: the lock, and its entry in the owner marker.

    Taken by process 0 only (`claim`); released by `release` or when the process exits.
    """

    def __init__(self, lock_file, run_id: str):
        self._lock_file, self.run_id = lock_file, run_id

    def release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the file drops the flock
            self._lock_file = None


def resolved(directory: str | Path, what: str = "checkpoint.dir") -> Path:
    """`directory` made absolute, symlinks followed; a loop of them, or a backslash in it, is one
    CheckpointError naming `what`."""
    try:
        path = Path(directory).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(f"{what} {directory} cannot be resolved: {e}") from None
    _no_backslash(path, what)
    return path


def _no_backslash(path: Path, what: str) -> None:
    """TensorStore, which writes orbax's arrays, reads a backslash as a path separator: the arrays of a
    checkpoint under `a\\b` would land in `a/b`, outside it."""
    if "\\" in str(path):
        raise CheckpointError(
            f"{what} {path} has a backslash in it, which TensorStore (orbax's array store) reads as a path "
            "separator: use a path without one"
        )


def claim(directory: str | Path, config_sha256: str, resume: bool) -> Claim:
    """Makes `directory` this run's checkpoint directory, or refuses with one line saying why.

    Accepted: a new or empty directory (the marker is written), a marked one without steps, and
    with `resume` a marked one with steps. Refused: a path that is a file, a non-empty directory
    without the marker, a marked directory with steps unless `resume`, and a directory another
    live run holds the lock of. Writing the marker is also the check that the directory is writable.
    """
    directory = resolved(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"checkpoint.dir {directory} is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir {directory} cannot be created: {e.strerror or e}") from None
    marker = read_marker(directory)
    if marker is None:  # a first claim that failed (a full disk), or one racing this, leaves these two
        entries = sorted(p.name for p in directory.iterdir() if p.name not in (LOCK, MARKER + ".tmp"))
        if entries:
            raise CheckpointError(
                f"checkpoint.dir {directory} is not empty ({len(entries)} entries: {', '.join(entries[:3])}"
                f"{', ...' if len(entries) > 3 else ''}) and jzero did not create it (no {MARKER}): "
                "use a new or empty directory"
            )
    lock_file = _lock(directory)
    try:
        trash = directory / DELETING
        if trash.is_symlink() or (trash.exists() and not trash.is_dir()):  # orbax would move steps through it
            raise CheckpointError(
                f"checkpoint.dir {directory}: {DELETING} is not a folder (a symlink or a file; jzero makes a "
                "folder there for the steps checkpoint.keep drops): remove it"
            )
        marker = read_marker(directory)  # again, held: a run that held the lock meanwhile may have written it
        saved = steps(directory) if marker is not None else []
        if saved and not resume:
            last = (marker["runs"] or [{"started": "?", "host": "?"}])[-1]
            raise CheckpointError(
                f"checkpoint.dir {directory} holds steps {span(saved)} of an earlier run (last started "
                f"{last['started']} on {last['host']}): continue it with --resume (without a DIR, or with "
                "this one), or use a new checkpoint.dir"
            )
        run_id = uuid.uuid4().hex[:12]
        marker = marker or {"format": FORMAT, "created": _now(), "runs": []}
        marker["runs"].append(
            {"run_id": run_id, "started": _now(), "host": socket.gethostname(), "pid": os.getpid(),
             "config_sha256": config_sha256, "steps_found": saved}
        )
        _write_atomic(directory / MARKER, json.dumps(marker, indent=1))
        purge_deleting(directory)  # what a killed run was deleting
    except BaseException:
        lock_file.close()  # a first claim that failed leaves its lock file, which the next claim accepts
        raise
    return Claim(lock_file, run_id)


def move_aside(directory: Path, step: int) -> Path:
    """Moves a damaged step to `damaged/`, so the run can save that step again; returns where."""
    target = directory / DAMAGED / f"{StepNames().build_name(step)}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(exist_ok=True)
    os.rename(directory / StepNames().build_name(step), target)
    return target


def purge_deleting(directory: Path) -> None:
    """Deletes the steps in `directory`'s `deleting/` (module docstring): only folders named as steps, never
    through a symlink; one that cannot be deleted now (permissions, a busy file) stays for a later purge."""
    if (directory / DELETING).is_symlink():  # `claim` refuses it; a purge never follows one
        return
    try:
        entries = list(os.scandir(directory / DELETING))
    except OSError:  # none yet, or unreadable now: best effort, the next purge tries again
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and re.fullmatch(r"step_\d{8,}", entry.name):
            shutil.rmtree(entry.path, ignore_errors=True)


def _lock(directory: Path):
    path = directory / LOCK
    if path.is_symlink() or not_a_file(path):  # jzero writes a plain file there, never
        raise CheckpointError(  # through a link (it would overwrite the file linked to), nor opens a FIFO
            f"checkpoint.dir {directory}: {LOCK} is not a regular file (jzero writes one there): remove it"
        )
    try:
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644), "a+")
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir {directory} is not writable: {e.strerror or e}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise CheckpointError(
            f"checkpoint.dir {directory} is in use by another jzero run ({holder}): "
            "wait for it to end or use another directory"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {_now()}\n")
    f.flush()
    return f


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # a full disk: the next try finds the directory as it was
        raise CheckpointError(f"checkpoint.dir {path.parent} is not writable: {e.strerror or e}") from None


def span(saved: list[int]) -> str:
    """Step numbers for a message: all of up to four, else the first and the last."""
    return ", ".join(map(str, saved)) if len(saved) <= 4 else f"{saved[0]}, ..., {saved[-1]}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
