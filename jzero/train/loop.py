"""The training harness: config -> mesh, model, ZeRO optimizer, jitted step -> metrics."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jzero.config import Config, OptimizerName, resolve_mesh
from jzero.mesh import make_mesh
from jzero.train.data import make_dataset
from jzero.train.model import GPTModel
from jzero.zero import Zero, build_zero, groups
from jzero.zero.state import TrainState


def lr_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to `optimizer.lr`, then cosine decay to 10% of it at `train.steps`."""
    o = cfg.optimizer
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=max(cfg.train.steps, o.warmup_steps + 1),
        end_value=0.1 * o.lr,
    )


def inner_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The element-wise optax chain the ZeRO wrapper shards (clipping lives in the wrapper).

    optax's own `sgd`, `adam` and `adamw` chains, with jzero's param-group pieces: the
    weight decay reads each param's `wd_mult`, a last step its `lr_mult`.
    """
    o, lr = cfg.optimizer, lr_schedule(cfg)
    if o.name == OptimizerName.ADAMW:
        return groups.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    if o.name == OptimizerName.SGD:
        direction = optax.trace(decay=o.b1) if o.b1 else optax.identity()
    else:
        direction = optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)
    return optax.chain(direction, optax.scale_by_learning_rate(lr), groups.scale_by_lr_mult())


def param_groups(cfg: Config, model: GPTModel, abstract_params) -> Any:
    """Megatron's param groups for the model: no weight decay for biases and 1-D params (unless
    `optimizer.weight_decay_1d`), then `optimizer.param_groups`; None if they change nothing."""
    o = cfg.optimizer
    has_decay = o.name == OptimizerName.ADAMW
    resolved = groups.param_groups(
        abstract_params,
        weight_decay_1d=o.weight_decay_1d or not has_decay,
        rules=o.param_groups,
        ndims=model.layer_ndims(abstract_params),
    )
    return None if groups.is_trivial(resolved) else resolved


@dataclasses.dataclass
class Run:
    """Everything one training run is built from; see `setup`."""

    cfg: Config
    model: GPTModel
    zero: Zero  # plan, shardings, init, step, grads: built once by jzero.zero.build_zero
    dataset: Any

    @property
    def mesh(self) -> Mesh:
        return self.zero.mesh

    def init_state(self) -> TrainState:
        return self.zero.init_state(self.model.init)

    def device_batch(self, step: int) -> jax.Array:
        """The global batch of `step`, split over the data-parallel domain.

        Every process computes the same global batch (it is a pure function of the step)
        and places only the rows of its own devices, so this also holds on many hosts.
        """
        batch = self.dataset.batch(step)
        return jax.make_array_from_callback(batch.shape, self.zero.batch_sharding, lambda index: batch[index])


def setup(cfg: Config, devices: list | None = None, with_data: bool = True) -> Run:
    """Resolves the mesh, model and ZeRO run for `cfg` (raises ConfigError on misfit).

    This is where a config meets its devices (default: all of JAX's devices, every process's),
    so `mesh.dp=-1` is filled in here, once; `Run.cfg` is the resolved config.
    with_data=False skips the dataset (compile-only tools never read it).
    """
    devices = jax.devices() if devices is None else devices
    cfg = resolve_mesh(cfg, len(devices))
    mesh = make_mesh(cfg.mesh, devices)
    model = GPTModel(cfg.model, param_dtype=jnp.dtype(cfg.precision.param_dtype.value), seed=cfg.train.seed)
    abstract = model.abstract_params()
    zero = build_zero(
        model.loss,
        inner_optimizer(cfg),
        mesh,
        abstract,
        model.tp_specs(abstract),
        cfg.zero,
        groups=param_groups(cfg, model, abstract),
        clip_grad=cfg.optimizer.clip_grad,
        microbatches=cfg.train.microbatches,
        grad_reduce_dtype=jnp.dtype(cfg.precision.grad_reduce_dtype.value),
    )
    return Run(cfg, model, zero, make_dataset(cfg) if with_data else None)


def train(
    cfg: Config, out_dir: Path, progress: bool = True, resume: str | None = None, resume_fallback: bool = False
) -> dict | None:
    """Trains up to `cfg.train.steps`; writes `out_dir/metrics.jsonl` and `summary.json`.

    Args:
      resume: None = start fresh; "" = resume from `checkpoint.dir`; else a checkpoint
        directory. Continues from its newest complete step (onto this config's mesh,
        strategy and path); checkpoints keep going to `checkpoint.dir` (default: there).
      resume_fallback: if the newest checkpoint is unreadable, use the one before it.
    Returns:
      the summary (see `report.summarize`), None if the checkpoint already reached the end,
      {} on processes other than 0 (only process 0 writes files and reports).
    """
    from jzero.train import report
    from jzero.train.checkpoint import Checkpointer, resolve_resume_dir

    run = setup(cfg)
    cfg = run.cfg  # mesh.dp resolved
    ck = cfg.checkpoint
    resume_dir = None if resume is None else resolve_resume_dir(cfg, resume or None)
    save_dir = ck.dir or resume_dir
    ckpt = Checkpointer(save_dir, run, ck.keep, ck.async_) if save_dir is not None else None
    try:
        if resume_dir is None:
            state, start = run.init_state(), 0
        else:
            reader = ckpt if Path(resume_dir).resolve() == ckpt.directory else Checkpointer(resume_dir, run, ck.keep)
            state, start = reader.restore_latest(resume_fallback)
        if start >= cfg.train.steps:
            print(f"checkpoint step {start} already reached train.steps={cfg.train.steps}: nothing to do")
            return None
        main_process = jax.process_index() == 0
        if main_process:
            out_dir.mkdir(parents=True, exist_ok=True)
        (metrics, state), compile_s = _loop(run, state, start, out_dir if main_process else None, ckpt, progress)
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for an in-flight async save
    summary = report.summarize(run, state, metrics, compile_s)
    if not main_process:
        return {}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _loop(run: Run, state: TrainState, start: int, out_dir: Path | None, ckpt, progress: bool):
    """Steps `start` .. `train.steps`; returns ((metrics, final state), compile seconds).

    out_dir None: write no metrics file (processes other than 0).
    """
    cfg = run.cfg
    t0 = time.perf_counter()
    step_fn = run.zero.step.lower(state, run.device_batch(start)).compile()  # compile outside the timings
    compile_s = time.perf_counter() - t0
    schedule = lr_schedule(cfg)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    metrics = []
    bar = _progress(cfg.train.steps, progress and out_dir is not None)
    bar.update(start)
    with open(out_dir / "metrics.jsonl" if out_dir else os.devnull, "w") as f:
        for step in range(start, cfg.train.steps):
            batch = run.device_batch(step)
            t = time.perf_counter()
            state, m = step_fn(state, batch)
            m = jax.device_get(m)
            dt = time.perf_counter() - t
            row = {
                "step": step + 1,
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "lr": float(schedule(step)),
                "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt,
            }
            if not np.isfinite(row["loss"]):
                raise FloatingPointError(f"loss is {row['loss']} at step {step + 1}")
            f.write(json.dumps(row) + "\n")
            f.flush()
            metrics.append(row)
            bar.update(1)
            if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps:
                bar.set_postfix(loss=f"{row['loss']:.4f}", gnorm=f"{row['grad_norm']:.3f}")
            if ckpt is not None and ((step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.train.steps):
                ckpt.save(state, cfg)
    bar.close()
    return (metrics, state), compile_s


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)
