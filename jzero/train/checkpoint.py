"""orbax checkpoints in model space, restorable onto any mesh, DP size, strategy or path: the `Checkpointer`.

The directory is one the run owns (`jzero.train.ckpt_dir`: marker, lock, step names). One
folder per saved step, `step_<8 digits>` (the number of steps completed), with two items
(`jzero.train.ckpt_step`):
  state/  arrays, per parameter and unflattened (Megatron's `fully_reshardable`):
          params/..., main_params/... (non-fp32 params only), opt_state/<moment>/...,
          grad_scaler/... (fp16's loss scale and trackers), spike/... (the grad-norm spike
          guard's history, with train.grad_norm_spike_factor), model_state/... (the model's
          non-trainable state, e.g. the MoE expert bias; absent for a model without), step.
          Flat-path buckets are converted to this form before saving.
  meta/   JSON: jzero's format, the writer's config and run id, the data position, every
          array's shape, dtype and fingerprint (`jzero.train.integrity`).
orbax writes each step to a temporary directory and commits it atomically, so a run
killed mid-save leaves the previous checkpoints intact and invisible partial ones. Every
restore checks each array against its fingerprint: overwritten or truncated data is named
by step, never trained on. All processes of a run save and restore jointly; a checkpoint
restores onto any process count.

The pieces, one responsibility each:
    jzero/train/checkpoint.py   the Checkpointer: one run's TrainState saved and restored in model space
    jzero/train/ckpt_step.py    one saved step: its items, read and checked (fit, damage)
    jzero/train/ckpt_dir.py     the directory a run owns: owner marker, writer lock, step names
    jzero/train/integrity.py    the arrays' fingerprints, and which restored arrays differ from them
    jzero/train/resume.py       the resume policy on a Checkpointer: which directory `--resume` reads, the newest
                                undamaged step (the fallback past damaged ones)
    jzero/train/ckpt_info.py    what `jzero ckpt info [--verify]` prints
    jzero/train/unraisable.py   the process-wide hook that drops orbax's abandoned-I/O noise
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jzero import multihost
from jzero.config import Config, to_dict
from jzero.errors import CheckpointError, RunError, one_line
from jzero.train import ckpt_dir
from jzero.train.ckpt_step import (
    ITEMS,
    DamagedStep,
    check_fits,
    from_nested,
    names,
    read_meta,
    saved_fingerprints,
    to_nested,
    with_empty,
    without_empty,
)
from jzero.train.data import data_identity
from jzero.train.integrity import fingerprints, mismatched
from jzero.train.preflight import disk_full, out_of_memory
from jzero.train.unraisable import quiet_abandoned_io
from jzero.zero.common import spike
from jzero.zero.common.state import TrainState, ZeroState


def config_sha256(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


_OOM = "out of memory: "  # `restore`'s failure, told apart from a damaged step across processes


class MainBridge(enum.Enum):
    """How a checkpoint's fp32 main params cross to a run that keeps them where the saving run did not, or
    the other way (fp32 params with and without `zero.param_gather_dtype`)."""

    MAIN_FROM_PARAMS = "main_from_params"  # the step has none: they are its fp32 params
    PARAMS_FROM_MAIN = "params_from_main"  # the step has them and this run keeps none: its params are them


class Checkpointer:
    """Saves and restores a run's TrainState in model space with an orbax CheckpointManager.

    writer=True claims `directory` for this run (`ckpt_dir.claim`: refuses a directory that is
    not jzero's, or holds another run's steps unless `resume`, or is locked by a live run) and
    keeps the newest `keep` steps; writer=False only reads a jzero checkpoint directory. The wait for a
    save's files (`check_saved`, a synchronous save) lasts at most `timeout_s` seconds (0: without a bound;
    `_within_timeout`), also orbax's own bound on an async save.
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
        timeout_s: float = 1800,
    ):
        if writer and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise CheckpointError(f"keep={keep!r}: a writer keeps at least its newest step (an integer >= 1)")
        self.run, self.writer, self.async_save, self.timeout_s = run, writer, async_save, timeout_s
        self._claim = None
        quiet_abandoned_io()
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
                todelete_subdir=ckpt_dir.DELETING if writer else None,  # dropped steps leave in one rename
                # orbax's own bound on an async save's writes and barriers (1200 s by default), as this run's
                async_options=ocp.AsyncOptions(timeout_secs=math.ceil(timeout_s) or UNBOUNDED_S),
            ),
            item_names=ITEMS,
        )
        self._saving: int | None = None  # the step of the save in flight
        self._stalled = False  # a save that did not finish within timeout_s: orbax's threads still wait on it
        self._seen: BaseException | None = None  # orbax's error of a failed save, reported already
        self._purge: threading.Thread | None = None  # deleting the steps `keep` dropped (`_purge_dropped`)
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
        if opt.spike is not None:
            tree["spike"] = opt.spike
        if state.model_state is not None:
            tree["model_state"] = state.model_state
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
        if opt.spike is not None:
            tree["spike"], shard["spike"] = opt.spike, model_sh.spike
        if abstract.model_state is not None:
            tree["model_state"], shard["model_state"] = abstract.model_state, sh.model_state
        return to_nested(
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shard)
        )

    def _abstract_params(self, abstract: TrainState):
        """The params tree (model space) of the state `abstract` (ShapeDtypeStructs)."""
        return jax.eval_shape(self.run.zero.full_params, abstract.params)

    def _bridged_target(self, meta: dict) -> tuple[dict, MainBridge | None]:
        """The model-space target to read `meta`'s step into, and how the fp32 main params cross between
        a run that keeps them and one that does not (fp32 params with and without `zero.param_gather_dtype`,
        `MainBridge`), or None."""
        target = self._abstract_model_state()
        saved_main = any(n.startswith("main_params/") for n in meta["arrays"])
        if "main_params" in target and not saved_main:
            fp32 = all(x.dtype == jnp.float32 for x in jax.tree.leaves(target["params"]))
            if fp32:
                return {k: v for k, v in target.items() if k != "main_params"}, MainBridge.MAIN_FROM_PARAMS
        if "main_params" not in target and saved_main:
            params = target["params"]
            as_main = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params)
            if all(x.dtype == jnp.float32 for x in jax.tree.leaves(params)):
                return {**target, "main_params": as_main}, MainBridge.PARAMS_FROM_MAIN
        return target, None

    # ------------------------------------------------------------ save

    def save(self, state: TrainState, cfg: Config) -> None:
        """Saves after `state.step` completed steps (async unless configured otherwise).

        Raises RunError, on every process, if this save or the one before it failed.
        """
        self.check_saved()
        step = int(state.step)
        nested = self._model_state(state)
        sums = names(jax.device_get(fingerprints(nested)))
        meta = {
            "format": ckpt_dir.FORMAT,
            "run_id": self._claim.run_id if self._claim is not None else None,
            "config": to_dict(cfg),
            "step": step,
            "data": {**data_identity(cfg), "position": step},
            "arrays": {
                n: {"shape": list(x.shape), "dtype": str(x.dtype), "fingerprint": int(sums[n])}
                for n, x in names(nested).items()
            },
        }
        def refuse_foreign():
            if (folder := ckpt_dir.foreign_step(self.directory, step)) is not None:
                raise RunError(f"cannot save checkpoint step {step}: {folder} is not jzero's; move it away")

        multihost.on_process_0(refuse_foreign, RunError)
        args = ocp.args.Composite(state=ocp.args.StandardSave(without_empty(nested)), meta=ocp.args.JsonSave(meta))
        save = functools.partial(self.manager.save, step, args=args, force=True)
        if self.async_save:  # orbax writes in its thread; `check_saved` waits for it
            self._saving = step
            try:
                save()
            except Exception as e:
                raise self._save_failed(step, e) from None
        else:  # the files are written here
            self._everywhere(lambda: self._within_timeout(step, save))
            self._purge_dropped()

    def _within_timeout(self, step: int, write) -> None:
        """`write()`, the save of `step` or the wait for it, waited for at most `timeout_s` (0: without a
        bound); RunError if it failed or did not end in time (a stalled filesystem: orbax's thread is left
        waiting on it, and `close` does not wait for it again)."""
        done, failure = threading.Event(), []

        def run():
            try:
                write()
            except Exception as e:
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name="jzero-checkpoint-save", daemon=True).start()
        if not done.wait(self.timeout_s or None):
            self._stalled = True
            raise RunError(
                f"checkpoint step {step} was not written to {self.directory} within checkpoint.timeout_s="
                f"{self.timeout_s:g} s (a stalled filesystem?); the steps saved before it are intact"
            )
        if failure:
            self._seen = failure[0]  # orbax raises it again in each thread that waits (`close`)
            raise self._save_failed(step, failure[0]) from None

    def _save_failed(self, step: int, e: Exception) -> RunError:
        """The one line for a save of `step` that failed with `e` (a full disk or quota named as such, not by
        the RESOURCE_EXHAUSTED TensorStore gives it); the uncommitted step is left in its temporary directory."""
        if disk_full(e):
            return RunError(
                f"no space left (on the device or in the quota) while saving checkpoint step {step} to "
                f"{self.directory}: free space there or lower checkpoint.keep; the steps saved before it are intact"
            )
        return RunError(f"saving checkpoint step {step} to {self.directory} failed: {one_line(e)}")

    def check_saved(self) -> None:
        """Waits for the save in flight, at most `timeout_s` (`_within_timeout`); RunError if it failed (orbax
        reports it here, once) or did not finish in time."""
        if self._saving is None:
            return
        step, self._saving = self._saving, None
        self._everywhere(lambda: self._within_timeout(step, self.manager.wait_until_finished))
        self._purge_dropped()

    @staticmethod
    def _everywhere(wait) -> None:
        """`wait()`, its RunError (a process's save that failed or stalled) raised on every process, so that none
        goes on to the next step's collectives without the others."""
        failure = None
        try:
            wait()
        except RunError as e:
            failure = str(e)
        if (failure := multihost.first_failure(failure)) is not None:
            raise RunError(failure)

    def _purge_dropped(self) -> None:
        """Deletes, on process 0 and beside the steps that follow, the steps `keep` dropped: orbax renamed
        them into `deleting/` as it committed the save (`ckpt_dir.purge_deleting`)."""
        if jax.process_index() != 0 or (self._purge is not None and self._purge.is_alive()):
            return  # one at a time; the next finds what this one did not
        self._purge = threading.Thread(
            target=ckpt_dir.purge_deleting, args=(self.directory,), name="jzero-purge-dropped-steps", daemon=True
        )
        self._purge.start()

    # ------------------------------------------------------------ restore

    def steps(self) -> list[int]:
        """Complete (committed) checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def meta(self, step: int) -> dict:
        return read_meta(self.directory, step, self.manager)

    def _read_meta(self, step: int) -> dict:
        """`meta(step)`, read again after a failure (`READ_ATTEMPTS`), every process hearing the same verdict;
        DamagedStep if it stays unreadable."""
        for attempt in range(READ_ATTEMPTS):
            meta, failure = None, None
            try:
                meta = self.meta(step)
            except CheckpointError as e:
                failure = str(e)
            failure = multihost.first_failure(failure)
            if failure is None:
                return meta
            if attempt == READ_ATTEMPTS - 1:
                raise DamagedStep(failure)
            time.sleep(READ_RETRY_S)

    def restore(self, step: int) -> TrainState:
        """Restores `step` straight into this run's shardings (no array is gathered whole).

        Raises DamagedStep if its meta or arrays are unreadable (`READ_ATTEMPTS` times each) or an array differs
        from its fingerprint,
        CheckpointError if it does not fit the model, or there is no complete step `step`.
        """
        steps = self.steps()
        if step not in steps:
            have = f"its steps are {', '.join(map(str, steps))}" if steps else "it holds no complete step"
            raise CheckpointError(f"no checkpoint step {step} in {self.directory}: {have}")
        meta = self._read_meta(step)
        target, bridge = self._bridged_target(meta)
        if not any(name.startswith("model_state/") for name in meta["arrays"]):
            target.pop("model_state", None)  # saved before the model kept state: it starts from its initial one
        target, keep_spike = self._spike_target(meta, target)
        check_fits(step, self.directory, meta, target)
        for attempt in range(READ_ATTEMPTS):  # a read error may be the filesystem's passing fault, not damage
            restored, failure = None, None
            try:
                restore = ocp.args.StandardRestore(without_empty(target))
                restored = self.manager.restore(step, args=ocp.args.Composite(state=restore))
            except Exception as e:  # orbax/tensorstore raise many types for a damaged file
                oom = out_of_memory(e, f"the restore of checkpoint step {step}")  # the device's, not the step's fault
                failure = f"checkpoint step {step} in {self.directory} is unreadable: {one_line(e)}"
                failure = _OOM + str(oom) if oom else failure
            failure = multihost.first_failure(failure)  # before any collective: one process may fail alone
            if failure is None or failure.startswith(_OOM) or attempt == READ_ATTEMPTS - 1:
                break
            time.sleep(READ_RETRY_S)
        if failure is not None and failure.startswith(_OOM):  # not damage: --resume-fallback must not move it
            raise RunError(failure.removeprefix(_OOM))
        if failure is not None:
            raise DamagedStep(failure)
        nested = with_empty(restored.state, target)
        bad = mismatched(saved_fingerprints(meta), names(nested))
        if bad:
            raise DamagedStep(
                f"checkpoint step {step} in {self.directory} is damaged: {len(bad)} arrays differ from the "
                f"fingerprints saved with them ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})",
            )
        abstract = jax.eval_shape(self.run.init_state)
        model_params = self._abstract_params(abstract)
        if bridge == MainBridge.MAIN_FROM_PARAMS:  # fp32 params are the main params exactly
            nested["main_params"] = jax.tree.map(lambda p: p.astype(jnp.float32), nested["params"])
        elif bridge == MainBridge.PARAMS_FROM_MAIN:  # the exact fp32 master, not the quantized gather's model copy
            nested["params"] = nested.pop("main_params")
        main = from_nested(nested["main_params"], model_params) if "main_params" in nested else None
        like_inner = jax.eval_shape(self.run.zero.to_model_space, abstract.opt_state).inner_state
        inner = from_nested(nested["opt_state"], like_inner)
        scaler = from_nested(nested["grad_scaler"], abstract.opt_state.grad_scaler) if "grad_scaler" in nested else None
        history = None
        if keep_spike:
            history = from_nested(nested["spike"], abstract.opt_state.spike)
        elif abstract.opt_state.spike is not None:
            history = jax.jit(spike.init, static_argnums=0, out_shardings=self.run.zero.model_opt_shardings.spike)(
                self.run.zero.options.spike_guard
            )
        opt = self._from_model(ZeroState(main, inner, scaler, history))
        params = self.run.zero.params_from_model(from_nested(nested["params"], model_params))
        model_state = None
        if "model_state" in nested:
            model_state = from_nested(nested["model_state"], abstract.model_state)
        elif abstract.model_state is not None:
            model_state = jax.jit(self.run.zero.model_state.init, out_shardings=self.run.zero.shardings.model_state)()
        return TrainState(params, opt, jnp.asarray(nested["step"], jnp.int32), model_state)

    def _spike_target(self, meta: dict, target: dict) -> tuple[dict, bool]:
        """`target` with the spike guard's history as the step saved it, and whether this run keeps it: a run
        without the guard, or with another `train.grad_norm_spike_window`, reads it (orbax restores whole
        trees) and starts its own history; a step saved without the guard starts a fresh one."""
        saved = {n[len("spike/"):]: a for n, a in meta["arrays"].items() if n.startswith("spike/")}
        mine = target.pop("spike", None)
        if not saved:
            return target, False
        keep = mine is not None and {n: list(x.shape) for n, x in names(mine).items()} == {
            n: a["shape"] for n, a in saved.items()
        }
        if keep:
            return {**target, "spike": mine}, True
        replicated = self.run.zero.shardings.step
        theirs = {n: jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"]), sharding=replicated)
                  for n, a in saved.items()}  # fmt: skip
        if mine is not None:
            _note(f"the checkpoint's grad-norm spike history holds {saved['norms']['shape'][0]} norms, "
                  "train.grad_norm_spike_window another number: the guard starts a new history")  # fmt: skip
        return {**target, "spike": theirs}, False

    def close(self, check: bool = True) -> None:
        """Waits for the save in flight, at most `timeout_s` (RunError if it failed and `check`; without `check`,
        the run's own failure being reported, on this process alone and quietly), releases the directory."""
        try:
            if check:
                self.check_saved()
            elif self._saving is not None:
                step, self._saving = self._saving, None
                try:
                    self._within_timeout(step, self.manager.wait_until_finished)
                except RunError:
                    pass  # the run's own failure is its report; this save's failure or stall is not added to it
            if not self._stalled:  # orbax's close would wait for the stalled save, without a bound
                try:
                    self.manager.close()
                except Exception as e:
                    if e is not self._seen:
                        raise
            if self._purge is not None:  # briefly: what is left, the next run that writes here deletes
                self._purge.join(timeout=PURGE_WAIT_S)
        finally:
            if self._claim is not None:
                self._claim.release()


# A step whose meta or arrays fail to read is read again before it counts as damaged (what
# `--resume-fallback` moves aside): a network filesystem's passing error (EIO, ESTALE, a timeout) is not damage.
READ_ATTEMPTS, READ_RETRY_S = 2, 2.0
# How long a closing run waits for dropped steps to be deleted (`Checkpointer.close`): briefly, as a
# multi-process run's other processes wait for process 0 to finish (distributed.timeout_s).
PURGE_WAIT_S = 5.0
UNBOUNDED_S = 2**31 - 1  # timeout_s=0 to orbax, which takes a number of seconds: 68 years


def _note(message: str) -> None:
    """One line on stderr from process 0: what a restore changed that the user may not expect."""
    if jax.process_index() == 0:
        print(f"jzero: note: {message}", file=sys.stderr, flush=True)
