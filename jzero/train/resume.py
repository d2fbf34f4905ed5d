"""The resume policy: which checkpoint directory `--resume [DIR]` reads, and what a damaged newest step does.

It builds on `jzero.train.checkpoint` (a `Checkpointer` saves and restores any one step), which
knows nothing of it:

- `resolve_resume_dir`: `--resume` without a step to read in `checkpoint.dir` starts from step 0
  there (a requeued job script can always pass --resume); any other directory must be jzero's.
- `restore_latest`: the newest complete step; a damaged one is an error naming it, or with
  `--resume-fallback` it is moved aside to `damaged/` (so the run can save that step again) and
  the next older step is tried.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from jzero import multihost
from jzero.config import Config
from jzero.errors import CheckpointError
from jzero.train import ckpt_dir
from jzero.train.ckpt_step import DamagedStep

if TYPE_CHECKING:
    from jzero.train.checkpoint import Checkpointer
    from jzero.zero.common.state import TrainState


def resolve_resume_dir(cfg: Config, resume: str | None) -> Path | None:
    """The checkpoint directory `--resume [DIR]` reads, resolved.

    None when it is `checkpoint.dir` and that holds no step yet (missing, empty, or created by a
    run that saved nothing): the run starts from step 0 and saves there, so a job script that is
    requeued can always pass --resume. Any other directory must be a jzero checkpoint directory.
    """
    directory = resume or cfg.checkpoint.dir
    if directory is None:
        raise CheckpointError("--resume needs a directory: pass one or set checkpoint.dir")
    path = ckpt_dir.resolved(directory, "--resume" if resume else "checkpoint.dir")
    if cfg.checkpoint.dir is not None and path == ckpt_dir.resolved(cfg.checkpoint.dir):
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            return None
        never_saved = not (path / ckpt_dir.DAMAGED).exists()  # else every step was damaged: an error below
        if path.is_dir() and ckpt_dir.read_marker(path) is not None and not ckpt_dir.steps(path) and never_saved:
            return None
    return ckpt_dir.open_for_reading(directory)


def restore_latest(
    checkpointer: Checkpointer, fallback: bool = False, say: Callable[[str], None] = print
) -> tuple[TrainState, int]:
    """The newest complete checkpoint of `checkpointer`'s directory, as (state, step).

    A damaged newest step is an error naming it; with `fallback`, `say` reports it in one line
    and the next older step is tried, the damaged one moved aside to `damaged/` (so this run can
    save that step again) where the directory is this run's own; one it only reads (`--resume DIR`
    beside another checkpoint.dir: another run's, maybe live, or read-only) is left as it is.
    """
    directory = checkpointer.directory
    steps = checkpointer.steps()
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    for step in reversed(steps):
        try:
            return checkpointer.restore(step), step
        except DamagedStep as e:
            if not fallback:
                raise CheckpointError(
                    f"{e}; --resume-fallback resumes from the newest undamaged step (and moves this one aside "
                    "where the run writes the directory)"
                ) from None
            if not checkpointer.writer:
                if jax.process_index() == 0:
                    say(f"jzero: {e}; skipped it (left in place: this run reads {directory}, it does not write there)")
                continue
            move = functools.partial(ckpt_dir.move_aside, directory, step)
            moved = multihost.on_process_0(move, CheckpointError)
            multihost.barrier(f"jzero-moved-{step}")
            checkpointer.manager.reload()
            if jax.process_index() == 0:
                say(f"jzero: {e}; moved it to {moved}")
    where = f"damaged ones: {ckpt_dir.DAMAGED}/" if checkpointer.writer else "every step damaged"
    raise CheckpointError(f"no undamaged checkpoint left in {directory} ({where})")
