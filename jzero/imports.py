"""What the config names by import path: a model's class (`model.impl: package.module:Class`) and an optax
optimizer (`optimizer.optax.name: lion`, `optax.contrib.muon`, `package.module:function`), imported with one
`ConfigError` naming the key when they cannot be.

Importing a user's module may import JAX, which reads `JAX_PLATFORMS` when it is imported, not when its
backend starts: `default_platforms` sets it first (as `jzero.runtime.start_jax` does), so naming an object
in the config never starts JAX on a platform the run does not use. Nothing here starts JAX's backend.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jzero.errors import ConfigError

# What the CUDA plugin's libraries (the gpu-aot extra) log on a machine with no NVIDIA driver, once per library as
# JAX imports them and once as it registers the plugin: absl's notice, then cudart_stub's line (`quiet_cuda_stub`).
_ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_CUDART_STUB = re.compile(r"I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine")


def _no_gpu() -> bool:
    return not Path("/dev/nvidiactl").exists()


def default_platforms() -> None:
    """`JAX_PLATFORMS=cpu` on a machine with no NVIDIA device, unless it is set: an installed CUDA plugin (the
    gpu-aot extra, for deviceless compilation) then does not fail loudly trying to start a GPU backend."""
    if "JAX_PLATFORMS" not in os.environ and _no_gpu():
        os.environ["JAX_PLATFORMS"] = "cpu"


@contextlib.contextmanager
def quiet_cuda_stub() -> Iterator[None]:
    """JAX imported inside, and its plugins registered after, without the CUDA plugin's lines that say a machine
    with no NVIDIA device has none (8 lines before every command's own). What else is written to stderr (fd 2)
    meanwhile is written after, in order. A no-op where JAX is imported already or an NVIDIA device exists."""
    saved = held = None
    if "jax" not in sys.modules and _no_gpu():
        try:
            held = tempfile.TemporaryFile()
            saved = os.dup(2)
        except OSError:  # no stderr to hold back from, or no room for a temporary file: JAX imported as is
            if held is not None:
                held.close()
            held = None
    if held is None:
        yield
        return
    sys.stderr.flush()
    try:
        with held:
            os.dup2(held.fileno(), 2)
            try:
                yield
                if "jax" in sys.modules:  # the plugins register when a backend starts: the last pair, here
                    from jax._src import xla_bridge

                    getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                lines = held.read().decode(errors="replace").splitlines(keepends=True)
                sys.stderr.write("".join(_without_stub(lines)))
                sys.stderr.flush()
    finally:
        os.close(saved)


def _without_stub(lines: list[str]) -> list[str]:
    """`lines` less cudart_stub's, and less absl's notice where one of them follows it."""
    stub = [bool(_CUDART_STUB.match(line)) for line in lines]
    notice = [line.rstrip("\n") == _ABSL_NOTICE and i + 1 < len(lines) and stub[i + 1] for i, line in enumerate(lines)]
    return [line for line, s, n in zip(lines, stub, notice) if not (s or n)]


def import_object(key: str, path: str, what: str = "Class", default_module: str | None = None) -> Any:
    """The object `path` names: "package.module:Name" (Name may be dotted: "module:Class.attr"); with
    `default_module`, also "package.module.name" and a bare "name" (an attribute of `default_module`).

    Raises ConfigError naming `key` when `path` has no such form, its module cannot be imported (or fails,
    or exits, when it runs), or the module has no such name.
    """
    module_name, sep, name = path.partition(":")
    if not sep and default_module is not None:
        module_name, _, name = path.rpartition(".")
        module_name, sep = module_name or default_module, ":"
    if not sep or not module_name or not name:
        form = f"a name in {default_module}, package.module.{what} or " if default_module else ""
        raise ConfigError(f"{key}={path!r} must look like {form}package.module:{what}")
    default_platforms()
    with quiet_cuda_stub():  # first, since a user's module may import JAX (its own lines are not held back)
        import jax  # noqa: F401
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # ImportError, or the module failed running: SyntaxError, sys.exit(), ...
        first = str(e).strip().partition("\n")[0]  # a message may span lines
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise ConfigError(f"{key}={path!r}: cannot import {module_name} ({why})") from None
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{key}={path!r}: module {module_name} has no {name}")
    return obj
