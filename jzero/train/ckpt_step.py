"""One saved step: its two orbax items, how they are read, and the checks a restore makes against them.

    step_00000006/
      state/  the arrays, as nested dicts with string keys (`to_nested`); an array's name is its
              path joined by "/" (`names`): params/blocks/0/mlp/fc1/kernel, opt_state/0/mu/..., step
      meta/   JSON: jzero's format, the writer's config and run id, the data position, and per array
              name its shape, dtype and fingerprint (`jzero.train.integrity`)

orbax cannot save an array of zero elements (a model's param of shape [0, D]): `state/` leaves
those out (`without_empty`), `meta/` lists them, and a restore makes them again from the run's
target (`with_empty`), so a model with one saves and restores like any other.

A step restores into a run only if every array the run holds is there with its shape and dtype
(`check_fits`); a step whose files cannot be read, or whose arrays differ from their fingerprints,
is a `DamagedStep`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jzero import multihost
from jzero.errors import CheckpointError, one_line
from jzero.paths import first_special
from jzero.train import ckpt_dir

ITEMS = ("state", "meta")


class DamagedStep(CheckpointError):
    """A saved step whose files are unreadable or whose arrays differ from their fingerprints."""


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise TypeError(f"unsupported pytree key {k!r}")


def to_nested(tree) -> dict:
    """A pytree as nested dicts with string keys (orbax- and JSON-friendly)."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        node = out
        for k in path[:-1]:
            node = node.setdefault(_key(k), {})
        node[_key(path[-1])] = leaf
    return out


def from_nested(nested: dict, like) -> Any:
    """Inverse of `to_nested`, into the structure of `like`."""

    def get(path):
        node = nested
        for k in path:
            node = node[_key(k)]
        return node

    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree.unflatten(treedef, [get(p) for p, _ in paths])


def names(nested: dict, prefix: str = "") -> dict[str, Any]:
    """The leaves of `nested` by name: their keys joined by "/"."""
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out |= names(v, f"{prefix}{k}/")
        else:
            out[prefix + k] = v
    return out


def without_empty(nested: dict) -> dict:
    """`nested` without its arrays (or ShapeDtypeStructs) of zero elements, nor the dicts they leave empty."""
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            if sub := without_empty(v):
                out[k] = sub
        elif math.prod(v.shape) > 0:
            out[k] = v
    return out


def with_empty(nested: dict, target: dict) -> dict:
    """`nested` (a restored `without_empty(target)`) with each zero-element leaf of `target`
    (ShapeDtypeStructs) made as an array of its shape, dtype and sharding."""
    out = dict(nested)
    for k, v in target.items():
        if isinstance(v, dict):
            out[k] = with_empty(nested.get(k, {}), v)
        elif math.prod(v.shape) == 0:
            out[k] = jnp.zeros(v.shape, v.dtype, device=v.sharding)
    return out


def reader(directory: str | Path) -> ocp.CheckpointManager:
    """A read-only orbax manager of `directory` that sees jzero's steps only (`ckpt_dir.StepNames`)."""
    return ocp.CheckpointManager(
        Path(directory).resolve(),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False, step_name_format=ckpt_dir.StepNames()),
        item_names=ITEMS,
    )


def read_meta(directory: str | Path, step: int, manager: ocp.CheckpointManager | None = None) -> dict:
    """The meta item of `step` in `directory`, checked to be jzero's (`_check_meta`); CheckpointError naming
    what is wrong where it is unreadable, not jzero's, or the step holds anything but files and folders
    (a FIFO would block orbax's read of it forever). With many processes, call it on all: the step's tree is
    walked by process 0 alone (on a parallel filesystem, thousands of processes' walks are a metadata storm)."""
    folder = Path(directory) / ckpt_dir.StepNames().build_name(step)

    def no_special_file():
        try:
            special = first_special(folder, recursive=True)
        except OSError as e:  # gone (renamed by another run's keep) or unreadable: said on every process
            raise CheckpointError(f"checkpoint step {step} in {directory}: unreadable ({one_line(e)})") from None
        if special is not None:
            raise CheckpointError(
                f"checkpoint step {step} in {directory}: unreadable ({special} is not a regular file: a FIFO or "
                "device would block the read)"
            )

    multihost.on_process_0(no_special_file, CheckpointError)
    manager = manager or reader(directory)
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:
        raise CheckpointError(f"checkpoint step {step} in {directory}: metadata unreadable ({one_line(e)})") from None
    if (problem := _check_meta(meta)) is not None:
        raise CheckpointError(f"checkpoint step {step} in {directory}: metadata unreadable ({problem})")
    return meta


def _check_meta(meta) -> str | None:
    """What in a step's meta item is not as jzero writes it (`Checkpointer.save`), or None."""
    if not isinstance(meta, dict) or meta.get("format") != ckpt_dir.FORMAT:
        return "not jzero's checkpoint format"
    for key in ("config", "data", "arrays"):
        if not isinstance(meta.get(key), dict):
            return f"its {key!r} is not a mapping"
    for name, a in meta["arrays"].items():
        ok = isinstance(a, dict) and isinstance(a.get("shape"), list) and isinstance(a.get("fingerprint"), int)
        ok = ok and all(isinstance(d, int) and d >= 0 for d in a["shape"]) and isinstance(a.get("dtype"), str)
        try:
            ok = ok and bool(jnp.dtype(a["dtype"]))
        except TypeError:
            ok = False
        if not ok:
            return f"array {name!r} has no shape, dtype and fingerprint as jzero writes them"
    return None


def check_fits(step: int, directory: Path, meta: dict, target: dict) -> None:
    """Raises CheckpointError unless the step's arrays (`meta`) have the shapes and dtypes of `target`'s
    (nested ShapeDtypeStructs), every one of them there; the step count may differ."""
    want = {n: (list(x.shape), str(x.dtype)) for n, x in names(target).items()}
    have = {n: (a["shape"], a["dtype"]) for n, a in meta["arrays"].items()}
    misfit = sorted(
        n for n in set(want) | set(have) if n != "step" and (n not in want or n not in have or want[n][0] != have[n][0])
    )
    if misfit:
        bad = [f"{n}: checkpoint {have[n][0] if n in have else 'missing'} vs model "
               f"{want[n][0] if n in want else 'absent'}" for n in misfit]  # fmt: skip
        hint = ""
        if all(n.startswith(("main_params/", "grad_scaler/")) and (n in want) != (n in have) for n in misfit):
            hint = (" (fp32 main params are kept only for params below float32, a loss scaler's state only for "
                    "float16: set precision.param_dtype as the run that saved it did)")  # on one side only; fmt: skip
        raise CheckpointError(
            f"checkpoint step {step} in {directory} does not fit the model ({len(bad)} arrays): "
            + "; ".join(bad[:20]) + hint
        )
    dtypes = sorted(n for n in set(want) & set(have) if want[n][1] != have[n][1])
    if dtypes:
        keys = [k for prefix, k in (("params/", "precision.param_dtype"), ("opt_state/", "optimizer.moments_dtype"))
                if any(n.startswith(prefix) for n in dtypes)]  # fmt: skip
        detail = "; ".join(f"{n}: checkpoint {have[n][1]} vs model {want[n][1]}" for n in dtypes[:5])
        raise CheckpointError(
            f"checkpoint step {step} in {directory}: dtypes differ ({len(dtypes)} arrays): {detail}"
            + (f" (set {' and '.join(keys)} as the run that saved it did)" if keys else "")
        )


def saved_fingerprints(meta: dict) -> dict[str, int]:
    """Per array name, the fingerprint saved with it."""
    return {n: a["fingerprint"] for n, a in meta["arrays"].items()}
