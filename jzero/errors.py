"""The errors jzero reports as one line: the CLI prints `jzero: error: <message>` and exits 2.

Every module that can fail on a user's input raises a subclass of `JzeroError` whose
message names the input (a config key, a file, a step, a process) and what to do.
This module imports nothing, so every other module may import it.
"""


def one_line(e: BaseException, limit: int = 160) -> str:
    """A library's exception (JAX, orbax, TensorStore) as one short line: its type and first line."""
    first = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    return f"{type(e).__name__}: {first[:limit]}{'...' if len(first) > limit else ''}"


class JzeroError(Exception):
    """A failure the user can act on; the message is the whole report (no traceback)."""


class ConfigError(JzeroError, ValueError):
    """A bad config key, value or combination; the message names the key."""


class CheckpointError(JzeroError, RuntimeError):
    """A checkpoint directory or step is missing, not ours, damaged, or does not fit the model."""


class RunError(JzeroError, RuntimeError):
    """A run cannot go on: a save failed, a process was lost, the loss is not finite."""


class Preempted(RunError):
    """SIGTERM stopped the run after a step (its checkpoint saved); the CLI exits 143 (128 + SIGTERM)."""

    exit_code = 143
