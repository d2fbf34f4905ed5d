"""What `jzero ckpt info [--verify]` prints: a checkpoint directory's steps and writer, and which steps are damaged.

Reads without a run (no model, no mesh): the metadata of the newest readable step, and with
`--verify` every array of every step, on this host's first device.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jzero.errors import CheckpointError, one_line
from jzero.train import ckpt_dir
from jzero.train.ckpt_step import names, read_meta, reader, saved_fingerprints, with_empty, without_empty
from jzero.train.integrity import mismatched
from jzero.train.unraisable import quiet_abandoned_io


def _verify(directory: Path, step: int, manager: ocp.CheckpointManager) -> str | None:
    """Reads every array of `step` on this host's first device; the problem in one line, or None."""
    try:
        meta = read_meta(directory, step, manager)
    except CheckpointError as e:
        return str(e)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target: dict = {}
    for name, a in meta["arrays"].items():
        *path, leaf = name.split("/")
        node = target
        for k in path:
            node = node.setdefault(k, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"]), sharding=device)
    try:
        restore = ocp.args.StandardRestore(without_empty(target))
        nested = with_empty(manager.restore(step, args=ocp.args.Composite(state=restore)).state, target)
    except Exception as e:
        return f"unreadable: {one_line(e)}"
    bad = mismatched(saved_fingerprints(meta), names(nested))
    return f"{len(bad)} arrays differ from their fingerprints ({', '.join(bad[:3])})" if bad else None


def describe(directory: str | Path) -> str:
    """`jzero ckpt info`: steps, the writer's strategy/mesh/dtypes, per-array shapes."""
    directory = ckpt_dir.open_for_reading(directory)
    manager = reader(directory)
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    readable = {}
    for step in reversed(steps):  # the writer as the newest step with readable metadata says
        try:
            readable[step] = read_meta(directory, step, manager)
            break
        except CheckpointError:
            continue
    if not readable:
        raise CheckpointError(f"no checkpoint in {directory} has readable metadata (steps {steps}): try --verify")
    (described, meta), = readable.items()
    c = meta["config"]
    lines = [
        f"{directory}: steps {', '.join(map(str, steps))} (latest {steps[-1]}; writer below from step {described})",
        f"writer: strategy={c['zero']['strategy']} path={c['zero']['path']} "
        f"mesh dp_outer={c['mesh']['dp_outer']} dp={c['mesh']['dp']} ep={c['mesh']['ep']} tp={c['mesh']['tp']} "
        f"param_dtype={c['precision']['param_dtype']} grad_reduce_dtype={c['precision']['grad_reduce_dtype']} "
        f"optimizer={c['optimizer']['name']}",
        f"data: {meta['data']['kind']} seed={meta['data']['seed']} position={meta['data']['position']}",
        f"arrays ({len(meta['arrays'])}):",
    ]
    lines += [f"  {n:48} {a['dtype']:9} {tuple(a['shape'])}" for n, a in sorted(meta["arrays"].items())]
    return "\n".join(lines)


def verify_steps(directory: str | Path) -> dict[int, str | None]:
    """`jzero ckpt info --verify`: every step's problem in one line (None = all arrays check out).

    Reads each step whole onto this host's first device, one step at a time.
    """
    quiet_abandoned_io()  # a damaged step's abandoned reads would print tracebacks after the report
    directory = ckpt_dir.open_for_reading(directory)
    manager = reader(directory)
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    return {step: _verify(directory, step, manager) for step in steps}
