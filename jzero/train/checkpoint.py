"""orbax checkpoints in model space, restorable onto any mesh, DP size, strategy or path.

One directory per saved step under `checkpoint.dir`, named by the number of steps
completed (orbax's default), each with two items:
  state/  arrays, per parameter and unflattened (Megatron's `fully_reshardable`):
          params/..., main_params/... (non-fp32 params only), opt_state/<moment>/...,
          step. Flat-path buckets are converted to this form before saving.
  meta/   JSON: the writer's config, the data position, every array's shape and dtype.
orbax writes each step to a temporary directory and commits it atomically, so a run
killed mid-save leaves the previous checkpoints intact and invisible partial ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jzero.config import Config, to_dict
from jzero.errors import CheckpointError
from jzero.zero.state import TrainState, ZeroState


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


def _names(nested: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out |= _names(v, f"{prefix}{k}/")
        else:
            out[prefix + k] = v
    return out


class Checkpointer:
    """Saves and restores a run's TrainState in model space with an orbax CheckpointManager."""

    def __init__(self, directory: str | Path, run, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).resolve()
        self.run = run
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True),
            item_names=("state", "meta"),
        )
        zero = run.zero
        self._to_model = jax.jit(zero.to_model_space, out_shardings=zero.model_opt_shardings)
        self._from_model = jax.jit(zero.from_model_space, out_shardings=zero.shardings.opt_state)

    # ------------------------------------------------------------ model space

    def _model_state(self, state: TrainState) -> dict:
        opt = self._to_model(state.opt_state)
        tree = {"params": state.params, "opt_state": opt.inner_state, "step": state.step}
        if opt.main_params is not None:
            tree["main_params"] = opt.main_params
        return to_nested(tree)

    def _abstract_model_state(self) -> dict:
        """The model-space target for this run: ShapeDtypeStructs in this run's shardings."""
        run = self.run
        abstract = jax.eval_shape(run.init_state)
        opt = jax.eval_shape(run.zero.to_model_space, abstract.opt_state)
        sh = run.zero.shardings
        model_sh = run.zero.model_opt_shardings
        tree = {"params": abstract.params, "opt_state": opt.inner_state, "step": abstract.step}
        shard = {"params": sh.params, "opt_state": model_sh.inner_state, "step": sh.step}
        if opt.main_params is not None:
            tree["main_params"], shard["main_params"] = opt.main_params, model_sh.main_params
        return to_nested(
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shard)
        )

    # ------------------------------------------------------------ save / restore

    def save(self, state: TrainState, cfg: Config) -> None:
        """Saves after `state.step` completed steps (async unless configured otherwise)."""
        step = int(state.step)
        nested = self._model_state(state)
        meta = {
            "config": to_dict(cfg),
            "step": step,
            "data": {"kind": cfg.data.kind.value, "seed": cfg.train.seed, "position": step},
            "arrays": {n: {"shape": list(x.shape), "dtype": str(x.dtype)} for n, x in _names(nested).items()},
        }
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(nested), meta=ocp.args.JsonSave(meta))
        )

    def steps(self) -> list[int]:
        """Complete (committed) checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def meta(self, step: int) -> dict:
        return read_meta(self.directory, step, self.manager)

    def restore(self, step: int) -> TrainState:
        """Restores `step` straight into this run's shardings (no array is gathered whole)."""
        meta = self.meta(step)
        target = self._abstract_model_state()
        want = {n: (list(x.shape), str(x.dtype)) for n, x in _names(target).items()}
        have = {n: (a["shape"], a["dtype"]) for n, a in meta["arrays"].items()}
        bad = sorted(
            f"{n}: checkpoint {have[n][0] if n in have else 'missing'} vs model {want[n][0] if n in want else 'absent'}"
            for n in set(want) | set(have)
            if n != "step" and (n not in want or n not in have or want[n][0] != have[n][0])
        )
        if bad:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not fit the model ({len(bad)} arrays): "
                + "; ".join(bad[:20])
            )
        dtypes = {n for n in set(want) & set(have) if want[n][1] != have[n][1]}
        if dtypes:
            raise CheckpointError(
                f"checkpoint step {step}: dtypes differ for {sorted(dtypes)[:5]} (precision.param_dtype?)"
            )
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except Exception as e:  # orbax/tensorstore raise many types for a damaged file
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is unreadable: {type(e).__name__}: {e}"
            ) from None
        nested = restored.state
        abstract = jax.eval_shape(self.run.init_state)
        main = from_nested(nested["main_params"], abstract.params) if "main_params" in nested else None
        like_inner = jax.eval_shape(self.run.zero.to_model_space, abstract.opt_state).inner_state
        inner = from_nested(nested["opt_state"], like_inner)
        opt = self._from_model(ZeroState(main, inner))
        params = from_nested(nested["params"], abstract.params)
        return TrainState(params, opt, jnp.asarray(nested["step"], jnp.int32))

    def restore_latest(self, fallback: bool = False) -> tuple[TrainState, int]:
        """The newest complete checkpoint; with `fallback`, older ones if it is unreadable."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        errors = []
        for step in reversed(steps):
            try:
                return self.restore(step), step
            except CheckpointError as e:
                if not fallback or "does not fit the model" in str(e):
                    raise
                errors.append(str(e))
        raise CheckpointError("no readable checkpoint: " + " | ".join(errors))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def read_meta(directory: str | Path, step: int, manager: ocp.CheckpointManager | None = None) -> dict:
    manager = manager or ocp.CheckpointManager(Path(directory).resolve(), item_names=("state", "meta"))
    try:
        return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:
        raise CheckpointError(
            f"checkpoint step {step} in {directory}: metadata unreadable ({type(e).__name__}: {e})"
        ) from None


def describe(directory: str | Path) -> str:
    """`jzero ckpt info`: steps, the writer's strategy/mesh/dtypes, per-array shapes."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    manager = ocp.CheckpointManager(directory.resolve(), item_names=("state", "meta"))
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    meta = read_meta(directory, steps[-1], manager)
    c = meta["config"]
    lines = [
        f"{directory}: steps {', '.join(map(str, steps))} (latest {steps[-1]})",
        f"writer: strategy={c['zero']['strategy']} path={c['zero']['path']} "
        f"mesh dp_outer={c['mesh']['dp_outer']} dp={c['mesh']['dp']} ep={c['mesh']['ep']} tp={c['mesh']['tp']} "
        f"param_dtype={c['precision']['param_dtype']} grad_reduce_dtype={c['precision']['grad_reduce_dtype']} "
        f"optimizer={c['optimizer']['name']}",
        f"data: {meta['data']['kind']} seed={meta['data']['seed']} position={meta['data']['position']}",
        f"arrays ({len(meta['arrays'])}):",
    ]
    lines += [f"  {n:48} {a['dtype']:9} {tuple(a['shape'])}" for n, a in sorted(meta["arrays"].items())]
    return "\n".join(lines)


def resolve_resume_dir(cfg: Config, resume: str | None) -> Path:
    directory = resume or cfg.checkpoint.dir
    if directory is None:
        raise CheckpointError("--resume needs a directory: pass one or set checkpoint.dir")
    if not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    return Path(directory)

