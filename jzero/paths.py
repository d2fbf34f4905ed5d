"""Where a run may write: the checks made before anything is created."""

from __future__ import annotations

import os
from pathlib import Path

from jzero.errors import ConfigError

RUN_FILES = ("metrics.jsonl", "summary.json")  # what a run writes in its output directory


def nearest_existing(path: Path) -> tuple[Path, str | None]:
    """The nearest of `path` and its parents that exists, a symbolic link counting (dangling or not), and
    what it is where a directory cannot be made at `path` under it: None where it is a directory, else
    "a file, not a directory", "a symbolic link to T, which does not exist" or "not a directory"."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
    if existing.is_dir():
        return existing, None
    if existing.is_file():
        return existing, "a file, not a directory"
    if existing.is_symlink() and not existing.exists():
        return existing, f"a symbolic link to {os.readlink(existing)}, which does not exist"
    return existing, "not a directory"


def refuse_unwritable(out: Path, name: str, out_is_named: bool = True) -> None:
    """ConfigError where a directory cannot be made at `out` (called `name`), or written in, before anything is
    created: the nearest existing of it and its parents is a file, a dangling link, or not writable. With
    `out_is_named` False, `name` speaks of a folder to be made under `out`, so what is wrong is always said of
    the path that has it."""
    existing, what = nearest_existing(Path(out))
    if what is not None:
        where = name if out_is_named and existing == Path(out) else f"{name}: {existing}"
        raise ConfigError(f"{where} is {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}: directory {existing} is not writable")


def refuse_other_runs_files(out: Path, name: str, hint: str = "choose a new --out, or continue that run with --resume"):
    """ConfigError where `out` (called `name` in the message, with `hint` after) holds another run's
    `RUN_FILES`: a fresh run never replaces them; only a resume continues them."""
    written = [f for f in RUN_FILES if (Path(out) / f).exists()]
    if written:
        files = " and ".join(written)
        raise ConfigError(f"{name} holds another run's {files}: a fresh run never replaces them; {hint}")


def not_a_file(path: Path) -> bool:
    """Whether `path` exists and is not a regular file (a folder, or a FIFO whose read would block forever)."""
    return Path(path).exists() and not Path(path).is_file()


def first_special(folder: Path, recursive: bool = False) -> Path | None:
    """The first entry under `folder` (its whole tree with `recursive`) that is neither a regular file nor
    a directory, links followed: a FIFO, socket or device, whose read would block or mean nothing. None if
    none. One `scandir` per folder, its entries' own types (no stat per entry but for links)."""
    stack = [Path(folder)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                if e.is_dir():
                    if recursive and not e.is_symlink():
                        stack.append(Path(e.path))
                elif not e.is_file():
                    return Path(e.path)
    return None
