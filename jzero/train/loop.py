"""The training harness: config -> mesh, model, ZeRO optimizer, jitted step -> metrics."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jzero.config import Config, OptimizerName, ZeroPath
from jzero.mesh import make_mesh
from jzero.train.data import make_dataset
from jzero.train.model import GPTModel
from jzero.zero.flat import build_flat_train_step, check_elementwise, flat_state_shardings, make_flat_plan
from jzero.zero.optimizer import state_shardings, zero_optimizer
from jzero.zero.step import (
    TrainState,
    batch_sharding,
    build_grads,
    build_train_step,
    init_train_state,
    train_state_shardings,
)
from jzero.zero.strategies import ShardingPlan, make_plan


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
    """The element-wise optax transformation the ZeRO wrapper shards (clipping lives in the wrapper)."""
    o, lr = cfg.optimizer, lr_schedule(cfg)
    if o.name == OptimizerName.SGD:
        return optax.sgd(lr, momentum=o.b1 or None)
    if o.name == OptimizerName.ADAM:
        return optax.adam(lr, b1=o.b1, b2=o.b2, eps=o.eps)
    # Weight decay on every param (optax's default): a per-tensor mask (Megatron skips biases
    # and norms) is not element-wise, so it could not run on the flat path's buffers.
    return optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


@dataclasses.dataclass
class Run:
    """Everything one training run is built from; see `setup`."""

    cfg: Config
    mesh: Mesh
    model: GPTModel
    plan: ShardingPlan
    inner: optax.GradientTransformation
    init_opt: Callable  # params -> optimizer state (under jit)
    shardings: TrainState
    step_fn: Callable  # jitted (state, batch) -> (state, metrics)
    grads_fn: Callable  # (params, batch) -> reduced grads, as the step holds them
    dataset: Any

    def init_state(self) -> TrainState:
        return init_train_state(self.model.init, self.init_opt, self.shardings)

    def device_batch(self, step: int) -> jax.Array:
        """The global batch of `step`, split over the data-parallel domain.

        Every process computes the same global batch (it is a pure function of the step)
        and places only the rows of its own devices, so this also holds on many hosts.
        """
        batch = self.dataset.batch(step)
        return jax.make_array_from_callback(batch.shape, batch_sharding(self.mesh), lambda index: batch[index])


def setup(cfg: Config, devices: list | None = None, with_data: bool = True) -> Run:
    """Resolves the mesh, shardings and jitted step for `cfg` (raises ConfigError on misfit).

    with_data=False skips the dataset (compile-only tools never read it).
    """
    mesh = make_mesh(cfg.mesh, devices)
    dtype = jnp.dtype(cfg.precision.param_dtype.value)
    model = GPTModel(cfg.model, param_dtype=dtype, seed=cfg.train.seed)
    abstract = model.abstract_params()
    plan = make_plan(mesh, cfg.zero.strategy, abstract, model.tp_specs(abstract))
    inner = inner_optimizer(cfg)
    reduce_dtype = jnp.dtype(cfg.precision.grad_reduce_dtype.value)
    micro, clip = cfg.train.microbatches, cfg.optimizer.clip_grad
    if cfg.zero.path == ZeroPath.FLAT:
        fp = make_flat_plan(plan, cfg.zero.bucket_size, cfg.zero.pad_for_high_nccl_busbw)
        check_elementwise(inner, abstract)
        shardings = train_state_shardings(plan, flat_state_shardings(inner, fp, keep_main=dtype != jnp.float32))
        flat = build_flat_train_step(
            model.loss, inner, fp, shardings, microbatches=micro, grad_reduce_dtype=reduce_dtype, clip_grad=clip
        )
        init_opt, step_fn, grads_fn = flat
    else:
        optimizer = zero_optimizer(inner, plan, clip)
        shardings = train_state_shardings(plan, state_shardings(inner, plan, abstract))
        step_fn = build_train_step(
            model.loss, optimizer, plan, shardings, microbatches=micro, grad_reduce_dtype=reduce_dtype
        )
        init_opt = optimizer.init
        grads_fn = build_grads(model.loss, plan, microbatches=micro, grad_reduce_dtype=reduce_dtype)
    dataset = make_dataset(cfg) if with_data else None
    return Run(cfg, mesh, model, plan, inner, init_opt, shardings, step_fn, grads_fn, dataset)


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
    step_fn = run.step_fn.lower(state, run.device_batch(start)).compile()  # compile outside the timings
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
