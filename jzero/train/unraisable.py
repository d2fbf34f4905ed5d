"""A process-wide `sys.unraisablehook` that drops the noise orbax's abandoned I/O makes after a failure.

After a failed save or restore, TensorStore completes the writes and reads orbax abandoned, and
their callbacks find orbax's event loop closed: Python reports each as an unraisable RuntimeError,
hundreds of tracebacks after jzero's one line; orbax's read coroutines that the failure left
unawaited report their errors when collected. `quiet_abandoned_io` (installed once, by the first
`jzero.train.checkpoint.Checkpointer`) drops exactly those; every other unraisable error reaches
the hook that was there before.
"""

from __future__ import annotations

import inspect
import sys


def quiet_abandoned_io() -> None:
    """Installs the hook (module docstring), once per process."""
    previous = sys.unraisablehook
    if getattr(previous, "jzero", False):
        return

    def hook(unraisable):
        e, source = unraisable.exc_value, unraisable.object
        closed_loop = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        orbax_read = inspect.iscoroutine(source) and "orbax" in source.cr_code.co_filename  # collected unawaited
        if not (closed_loop or orbax_read):
            previous(unraisable)

    hook.jzero = True
    sys.unraisablehook = hook
