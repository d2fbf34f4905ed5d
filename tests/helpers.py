"""Shared test fixtures: a tiny config and the plain single-device optax reference."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax

from jzero.config import Config, from_dict
from jzero.train.loop import inner_optimizer, setup
from jzero.train.model import GPTModel
from jzero.zero.optimizer import clip_by_global_norm

STEPS = 5


def tiny_config(strategy="optim_grads", mesh=(8, 1, 1), microbatches=1, **sections) -> Config:
    """A GPT whose sizes do not all divide the mesh (vocab 257), on synthetic data."""
    dp, ep, tp = mesh
    raw = {
        "model": dict(vocab_size=257, d_model=64, n_layers=2, n_heads=4, d_ff=128, seq_len=16, tie_embeddings=False),
        "mesh": dict(dp=dp, ep=ep, tp=tp),
        "zero": {"strategy": strategy},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2},
        "train": dict(steps=STEPS, global_batch=16, microbatches=microbatches),
        "data": {"kind": "synthetic"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return from_dict(raw)


@functools.lru_cache(maxsize=None)
def reference_run(cfg: Config, steps: int = STEPS):
    """Plain single-device optax on the same batches: (losses, grad norms, params per step).

    Depends only on model, optimizer, data and seed, never on mesh or strategy.
    """
    model = GPTModel(cfg.model, seed=cfg.train.seed)
    tx = inner_optimizer(cfg)
    device = jax.devices()[0]
    params = jax.jit(model.init, device=device)()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        grads, norm = clip_by_global_norm(grads, cfg.optimizer.clip_grad)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, norm

    data = setup_free_dataset(cfg)
    init = jax.device_get(params)
    losses, norms = [], []
    for i in range(steps):
        params, opt_state, loss, norm = step(params, opt_state, jax.device_put(data.batch(i), device))
        losses.append(float(loss))
        norms.append(float(norm))
    return init, np.array(losses), np.array(norms), jax.device_get(params)


def setup_free_dataset(cfg: Config):
    from jzero.train.data import make_dataset

    return make_dataset(cfg)


def run_steps(cfg: Config, steps: int = STEPS, devices=None):
    """Trains `steps` steps with jzero; returns (run, initial params, losses, norms, state)."""
    run = setup(cfg, devices)
    state = run.init_state()
    init = jax.device_get(state.params)
    losses, norms = [], []
    for i in range(steps):
        state, m = run.step_fn(state, run.device_batch(i))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return run, init, np.array(losses), np.array(norms), state


def rel_param_errors(params, ref) -> dict[str, float]:
    """|p - p_ref| / |p_ref| per tensor (Frobenius norms), in fp32."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    ref_flat = jax.tree.leaves(ref)
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): float(
            np.linalg.norm(np.asarray(p, np.float32) - r) / np.linalg.norm(r)
        )
        for (path, p), r in zip(flat, ref_flat)
    }
