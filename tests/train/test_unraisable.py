"""jzero.train.unraisable: the process-wide hook drops exactly orbax's abandoned-I/O noise, once installed."""

import sys
import types

from jzero.train.unraisable import quiet_abandoned_io


def test_the_hook_drops_closed_loop_errors_and_passes_every_other_on(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    quiet_abandoned_io()
    hook = sys.unraisablehook
    quiet_abandoned_io()  # once: a second call keeps the first hook
    assert sys.unraisablehook is hook and hook is not seen.append

    def unraisable(e, source=None):
        return types.SimpleNamespace(exc_value=e, object=source)

    hook(unraisable(RuntimeError("Event loop is closed")))
    assert seen == []
    others = [unraisable(RuntimeError("something else")), unraisable(ValueError("Event loop is closed"))]
    for u in others:
        hook(u)
    assert seen == others
