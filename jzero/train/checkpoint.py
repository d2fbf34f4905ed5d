"""orbax checkpoints in model space, restorable onto any mesh, DP size, strategy or path.

The directory is one the run owns (`jzero.train.ckpt_dir`: marker, lock, step names). One
folder per saved step, `step_<8 digits>` (the number of steps completed), with two items:
  state/  arrays, per parameter and unflattened (Megatron's `fully_reshardable`):
          params/..., main_params/... (non-fp32 params only), opt_state/<moment>/...,
          grad_scaler/... (fp16's loss scale and trackers), step. Flat-path buckets are
          converted to this form before saving.
  meta/   JSON: jzero's format, the writer's config and run id, the data position, every
          array's shape, dtype and fingerprint (`jzero.train.integrity`).
orbax writes each step to a temporary directory and commits it atomically, so a run
killed mid-save leaves the previous checkpoints intact and invisible partial ones. Every
restore checks each array against its fingerprint: overwritten or truncated data is named
by step, never trained on. All processes of a run save and restore jointly; a checkpoint
restores onto any process count.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jzero import multihost
from jzero.config import Config, to_dict
from jzero.errors import CheckpointError, RunError, one_line
from jzero.train import ckpt_dir
from jzero.train.data import data_identity
from jzero.train.integrity import fingerprints
from jzero.zero.common.state import TrainState, ZeroState


class DamagedStep(CheckpointError):
    """A saved step whose files are unreadable or whose arrays differ from their fingerprints."""


def _quiet_abandoned_io() -> None:
    """After a failed save or restore, TensorStore completes the writes and reads orbax abandoned,
    and their callbacks find orbax's event loop closed: Python reports each as an unraisable
    RuntimeError, hundreds of tracebacks after jzero's one line; orbax's read coroutines that the
    failure left unawaited report their errors when collected. Installed once (by the first
    Checkpointer), this drops exactly those; every other unraisable error reaches the old hook."""
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


def config_sha256(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


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
    """Saves and restores a run's TrainState in model space with an orbax CheckpointManager.

    writer=True claims `directory` for this run (`ckpt_dir.claim`: refuses a directory that is
    not jzero's, or holds another run's steps unless `resume`, or is locked by a live run) and
    keeps the newest `keep` steps; writer=False only reads a jzero checkpoint directory.
    """

    def __init__(
        self,
        directory: str | Path,
        run,
        *,
        keep: int = 3,
        async_save: bool = True,
        writer: bool = True,
        resume: bool = False,
    ):
        self.run = run
        self._claim = None
        _quiet_abandoned_io()
        if writer:
            self._claim = multihost.on_process_0(
                lambda: ckpt_dir.claim(directory, config_sha256(run.cfg), resume), CheckpointError
            )
            self.directory = Path(directory).resolve()
        else:
            self.directory = ckpt_dir.open_for_reading(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep if writer else None,
                enable_async_checkpointing=async_save,
                create=False,
                read_only=not writer,
                step_name_format=ckpt_dir.StepNames(),
                cleanup_tmp_directories=writer,  # a killed run's uncommitted step_*.orbax-checkpoint-tmp
            ),
            item_names=("state", "meta"),
        )
        self._saving: int | None = None  # the step of the save in flight
        zero = run.zero
        self._to_model = jax.jit(zero.to_model_space, out_shardings=zero.model_opt_shardings)
        self._from_model = jax.jit(zero.from_model_space, out_shardings=zero.shardings.opt_state)

    # ------------------------------------------------------------ model space

    def _model_state(self, state: TrainState) -> dict:
        opt = self._to_model(state.opt_state)
        tree = {"params": self.run.zero.full_params(state.params), "opt_state": opt.inner_state, "step": state.step}
        if opt.main_params is not None:
            tree["main_params"] = opt.main_params
        if opt.grad_scaler is not None:
            tree["grad_scaler"] = opt.grad_scaler
        return to_nested(tree)

    def _abstract_model_state(self) -> dict:
        """The model-space target for this run: ShapeDtypeStructs in this run's shardings."""
        run = self.run
        abstract = jax.eval_shape(run.init_state)
        opt = jax.eval_shape(run.zero.to_model_space, abstract.opt_state)
        sh = run.zero.shardings
        model_sh = run.zero.model_opt_shardings
        params = self._abstract_params(abstract)
        tree = {"params": params, "opt_state": opt.inner_state, "step": abstract.step}
        shard = {"params": run.zero.model_param_shardings, "opt_state": model_sh.inner_state, "step": sh.step}
        if opt.main_params is not None:
            tree["main_params"], shard["main_params"] = opt.main_params, model_sh.main_params
        if opt.grad_scaler is not None:
            tree["grad_scaler"], shard["grad_scaler"] = opt.grad_scaler, model_sh.grad_scaler
        return to_nested(
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shard)
        )

    def _abstract_params(self, abstract: TrainState):
        """The params tree (model space) of the state `abstract` (ShapeDtypeStructs)."""
        return jax.eval_shape(self.run.zero.full_params, abstract.params)

    # ------------------------------------------------------------ save

    def save(self, state: TrainState, cfg: Config) -> None:
        """Saves after `state.step` completed steps (async unless configured otherwise).

        Raises RunError, on every process, if this save or the one before it failed.
        """
        self.check_saved()
        step = int(state.step)
        nested = self._model_state(state)
        sums = _names(jax.device_get(fingerprints(nested)))
        meta = {
            "format": ckpt_dir.FORMAT,
            "run_id": self._claim.run_id if self._claim is not None else None,
            "config": to_dict(cfg),
            "step": step,
            "data": {**data_identity(cfg), "position": step},
            "arrays": {
                n: {"shape": list(x.shape), "dtype": str(x.dtype), "fingerprint": int(sums[n])}
                for n, x in _names(nested).items()
            },
        }
        def refuse_foreign():
            if (folder := ckpt_dir.foreign_step(self.directory, step)) is not None:
                raise RunError(f"cannot save checkpoint step {step}: {folder} is not jzero's; move it away")

        multihost.on_process_0(refuse_foreign, RunError)
        self._saving = step
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(nested), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
        except Exception as e:
            raise RunError(f"saving checkpoint step {step} to {self.directory} failed: {one_line(e)}") from None

    def check_saved(self) -> None:
        """Waits for the save in flight; RunError if it failed (orbax reports it here, once)."""
        if self._saving is None:
            return
        step, self._saving = self._saving, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise RunError(f"saving checkpoint step {step} to {self.directory} failed: {one_line(e)}") from None

    # ------------------------------------------------------------ restore

    def steps(self) -> list[int]:
        """Complete (committed) checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def meta(self, step: int) -> dict:
        return read_meta(self.directory, step, self.manager)

    def restore(self, step: int) -> TrainState:
        """Restores `step` straight into this run's shardings (no array is gathered whole).

        Raises DamagedStep if its files are unreadable or an array differs from its fingerprint,
        CheckpointError if it does not fit the model.
        """
        try:
            meta = self.meta(step)
        except CheckpointError as e:
            raise DamagedStep(str(e)) from None
        target = self._abstract_model_state()
        _check_fits(step, self.directory, meta, target)
        restored, failure = None, None
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except Exception as e:  # orbax/tensorstore raise many types for a damaged file
            failure = f"checkpoint step {step} in {self.directory} is unreadable: {one_line(e)}"
        failure = multihost.first_failure(failure)  # before any collective: one process may fail alone
        if failure is not None:
            raise DamagedStep(failure)
        nested = restored.state
        bad = _mismatched(meta, nested)
        if bad:
            raise DamagedStep(
                f"checkpoint step {step} in {self.directory} is damaged: {len(bad)} arrays differ from the "
                f"fingerprints saved with them ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})",
            )
        abstract = jax.eval_shape(self.run.init_state)
        model_params = self._abstract_params(abstract)
        main = from_nested(nested["main_params"], model_params) if "main_params" in nested else None
        like_inner = jax.eval_shape(self.run.zero.to_model_space, abstract.opt_state).inner_state
        inner = from_nested(nested["opt_state"], like_inner)
        scaler = from_nested(nested["grad_scaler"], abstract.opt_state.grad_scaler) if "grad_scaler" in nested else None
        opt = self._from_model(ZeroState(main, inner, scaler))
        params = self.run.zero.params_from_model(from_nested(nested["params"], model_params))
        return TrainState(params, opt, jnp.asarray(nested["step"], jnp.int32))

    def restore_latest(self, fallback: bool = False, say: Callable[[str], None] = print) -> tuple[TrainState, int]:
        """The newest complete checkpoint, as (state, step).

        A damaged newest step is an error naming it; with `fallback`, it is moved aside to
        `damaged/` (so this run can save that step again), `say` reports it in one line, and
        the next older step is tried.
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        for step in reversed(steps):
            try:
                return self.restore(step), step
            except DamagedStep as e:
                if not fallback:
                    raise CheckpointError(
                        f"{e}; --resume-fallback resumes from the newest undamaged step and moves this one aside"
                    ) from None
                move = functools.partial(ckpt_dir.move_aside, self.directory, step)
                moved = multihost.on_process_0(move, CheckpointError)
                multihost.barrier(f"jzero-moved-{step}")
                self.manager.reload()
                if jax.process_index() == 0:
                    say(f"jzero: {e}; moved it to {moved}")
        raise CheckpointError(f"no undamaged checkpoint left in {self.directory} (damaged ones: {ckpt_dir.DAMAGED}/)")

    def close(self, check: bool = True) -> None:
        """Waits for the save in flight (RunError if it failed and `check`), releases the directory."""
        try:
            if check:
                self.check_saved()
            self.manager.close()
        finally:
            if self._claim is not None:
                self._claim.release()


def _check_fits(step: int, directory: Path, meta: dict, target: dict) -> None:
    want = {n: (list(x.shape), str(x.dtype)) for n, x in _names(target).items()}
    have = {n: (a["shape"], a["dtype"]) for n, a in meta["arrays"].items()}
    bad = sorted(
        f"{n}: checkpoint {have[n][0] if n in have else 'missing'} vs model {want[n][0] if n in want else 'absent'}"
        for n in set(want) | set(have)
        if n != "step" and (n not in want or n not in have or want[n][0] != have[n][0])
    )
    if bad:
        raise CheckpointError(
            f"checkpoint step {step} in {directory} does not fit the model ({len(bad)} arrays): " + "; ".join(bad[:20])
        )
    dtypes = {n for n in set(want) & set(have) if want[n][1] != have[n][1]}
    if dtypes:
        raise CheckpointError(
            f"checkpoint step {step}: dtypes differ for {sorted(dtypes)[:5]} (precision.param_dtype?)"
        )


def _mismatched(meta: dict, nested: dict) -> list[str]:
    """Names of the restored arrays whose fingerprint differs from the one saved in `meta`."""
    sums = _names(jax.device_get(fingerprints(nested)))
    return sorted(n for n, a in meta["arrays"].items() if int(sums[n]) != a["fingerprint"])


def read_meta(directory: str | Path, step: int, manager: ocp.CheckpointManager | None = None) -> dict:
    manager = manager or _reader(directory)
    try:
        return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:
        raise CheckpointError(f"checkpoint step {step} in {directory}: metadata unreadable ({one_line(e)})") from None


def _reader(directory: str | Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        Path(directory).resolve(),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False, step_name_format=ckpt_dir.StepNames()),
        item_names=("state", "meta"),
    )


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
        nested = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
    except Exception as e:
        return f"unreadable: {one_line(e)}"
    bad = _mismatched(meta, nested)
    return f"{len(bad)} arrays differ from their fingerprints ({', '.join(bad[:3])})" if bad else None


def describe(directory: str | Path) -> str:
    """`jzero ckpt info`: steps, the writer's strategy/mesh/dtypes, per-array shapes."""
    directory = ckpt_dir.open_for_reading(directory)
    manager = _reader(directory)
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
    directory = ckpt_dir.open_for_reading(directory)
    manager = _reader(directory)
    return {step: _verify(directory, step, manager) for step in sorted(manager.all_steps())}


def resolve_resume_dir(cfg: Config, resume: str | None) -> Path | None:
    """The checkpoint directory `--resume [DIR]` reads, resolved.

    None when it is `checkpoint.dir` and that holds no step yet (missing, empty, or created by a
    run that saved nothing): the run starts from step 0 and saves there, so a job script that is
    requeued can always pass --resume. Any other directory must be a jzero checkpoint directory.
    """
    directory = resume or cfg.checkpoint.dir
    if directory is None:
        raise CheckpointError("--resume needs a directory: pass one or set checkpoint.dir")
    path = Path(directory).resolve()
    if cfg.checkpoint.dir is not None and path == Path(cfg.checkpoint.dir).resolve():
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            return None
        never_saved = not (path / ckpt_dir.DAMAGED).exists()  # else every step was damaged: an error below
        if path.is_dir() and ckpt_dir.read_marker(path) is not None and not ckpt_dir.steps(path) and never_saved:
            return None
    return ckpt_dir.open_for_reading(directory)
