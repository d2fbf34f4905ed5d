"""Agreement between the processes of a multi-process run (all of it a no-op with one process).

A step that only one process should take (writing a marker, moving a folder) runs on process 0,
and its outcome reaches every process, so all of them go on or all stop with the same one-line
error; a failure that one process sees (an unreadable file) is made everyone's before the next
collective, so no process waits in a collective the others never enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from jzero.errors import JzeroError, RunError

T = TypeVar("T")
_MESSAGE_BYTES = 2048


def on_process_0(fn: Callable[[], T], error: type[JzeroError]) -> T | None:
    """Runs `fn` on process 0 only; its JzeroError is raised on every process (as `error` elsewhere).

    Returns fn's result on process 0, None on the others.
    """
    if jax.process_count() == 1:
        return fn()
    result, failure = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except JzeroError as e:
            failure = e
    message = _decode(np.asarray(multihost_utils.broadcast_one_to_all(_encode(failure and str(failure)))))
    if failure is not None:
        raise failure
    if message is not None:
        raise error(message)
    return result


def first_failure(message: str | None) -> str | None:
    """Every process's `message` (None = fine) -> the lowest-numbered process's, on all processes."""
    if jax.process_count() == 1:
        return message
    for i, row in enumerate(np.asarray(multihost_utils.process_allgather(_encode(message)))):
        if (text := _decode(row)) is not None:
            return text if i == 0 else f"{text} (process {i})"
    return None


def same_everywhere(fact: str, what: str) -> None:
    """RunError on every process unless every process computed the same `fact` (e.g. what a file
    system shows it); `what` names the thing that differs."""
    if jax.process_count() == 1:
        return
    rows = np.asarray(multihost_utils.process_allgather(_encode(fact)))
    for i, row in enumerate(rows[1:], start=1):
        if not np.array_equal(row, rows[0]):
            raise RunError(f"process 0 and process {i} see different {what}: {_decode(rows[0])!r} vs {_decode(row)!r}")


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any."""
    if jax.process_count() == 1:
        return flag
    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def _encode(message: str | None) -> np.ndarray:
    """A message as a fixed-size byte row (collectives need equal shapes): [is-set, utf-8...]."""
    text = (message or "").encode()[:_MESSAGE_BYTES]
    row = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
    row[0], row[1 : 1 + len(text)] = message is not None, np.frombuffer(text, np.uint8)
    return row


def _decode(row: np.ndarray) -> str | None:
    return bytes(row[1:]).rstrip(b"\0").decode(errors="replace") if row[0] else None


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
