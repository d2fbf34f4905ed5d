"""What the config names by import path: a model's class (`model.impl: package.module:Class`) and an optax
optimizer (`optimizer.optax.name: lion`, `optax.contrib.muon`, `package.module:function`), imported with one
`ConfigError` naming the key when they cannot be.

Importing a user's module may import JAX, which reads `JAX_PLATFORMS` when it is imported, not when its
backend starts: `default_platforms` sets it first (as `jzero.runtime.start_jax` does), so naming an object
in the config never starts JAX on a platform the run does not use. Nothing here starts JAX's backend.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from jzero.errors import ConfigError


def default_platforms() -> None:
    """`JAX_PLATFORMS=cpu` on a machine with no NVIDIA device, unless it is set: an installed CUDA plugin (the
    gpu-aot extra, for deviceless compilation) then does not fail loudly trying to start a GPU backend."""
    if "JAX_PLATFORMS" not in os.environ and not Path("/dev/nvidiactl").exists():
        os.environ["JAX_PLATFORMS"] = "cpu"


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
