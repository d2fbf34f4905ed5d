"""Shared test fixtures: a tiny config and the plain single-device optax reference."""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import SingleDeviceSharding

from jzero.config import Config, OptimizerName, from_dict
from jzero.mesh import MeshConfig
from jzero.train.loop import Run, lr_schedule, param_groups, setup
from jzero.train.model import GPTModel
from jzero.zero.common.groups import ParamGroup
from jzero.zero.common.state import TrainState
from jzero.zero.common.update import clip_by_global_norm
from jzero.zero.config import ZeroConfig

STEPS = 5
REFERENCE_DIR = "JZERO_TEST_REFERENCES"  # env var: the session's directory of computed references


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


def plain_optax(cfg: Config, model: GPTModel) -> optax.GradientTransformation:
    """What a user writes in plain optax for `cfg`'s optimizer and param groups: optax's own
    adamw / adam / sgd, one per group (its lr x lr_mult, its weight decay x wd_mult), by
    `optax.multi_transform`. jzero's group-aware chain must train to the same numbers."""
    o, lr = cfg.optimizer, lr_schedule(cfg)
    abstract = model.abstract_params()
    groups = param_groups(cfg, model, abstract)
    if groups is None:
        groups = jax.tree.map(lambda _: ParamGroup(), abstract)

    def make(g: ParamGroup):
        rate = lr if g.lr_mult == 1.0 else (lambda count: lr(count) * g.lr_mult)
        if o.name == OptimizerName.ADAMW:
            return optax.adamw(rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay * g.wd_mult)
        if o.name == OptimizerName.ADAM:
            return optax.adam(rate, b1=o.b1, b2=o.b2, eps=o.eps)
        return optax.sgd(rate, momentum=o.b1 or None)

    is_group = lambda g: isinstance(g, ParamGroup)  # noqa: E731
    distinct = sorted(set(jax.tree.leaves(groups, is_leaf=is_group)))
    labels = jax.tree.map(lambda g: str(distinct.index(g)), groups, is_leaf=is_group)
    return optax.multi_transform({str(i): make(g) for i, g in enumerate(distinct)}, labels)


def reference_run(cfg: Config, steps: int = STEPS):
    """Plain single-device optax on the same batches: (losses, grad norms, params per step).

    Depends only on model, optimizer, data and seed, never on strategy or path, so one run
    serves every such variant of a config. A dense model's loss is a mean over tokens, the
    same whatever the split; a MoE model routes each rank's microbatch on its own (capacity,
    load-balancing loss), so the reference routes the same groups of rows: the global batch
    in dp_domain_size x microbatches contiguous groups (`jzero.zero.common.batch`), loss averaged.
    """
    groups = cfg.dp_domain_size * cfg.train.microbatches if cfg.model.moe.num_experts else 1
    train = dataclasses.replace(cfg.train, microbatches=1)
    return _reference_run(dataclasses.replace(cfg, mesh=MeshConfig(), zero=ZeroConfig(), train=train), steps, groups)


def grouped_loss(model: GPTModel, groups: int):
    """The mean of `model.loss` over `groups` contiguous groups of the batch's rows."""

    def loss(params, batch):
        return jnp.mean(jax.vmap(lambda rows: model.loss(params, rows))(batch.reshape(groups, -1, *batch.shape[1:])))

    return loss if groups > 1 else model.loss


def _once_per_session(key: str, compute: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
    """`compute()` (named arrays), computed once per test session: the first pytest-xdist worker to
    need `key` computes it under a file lock and saves it in the session's directory (`conftest.py`),
    the others load it. Returns (the arrays, whether this call computed them)."""
    shared = os.environ.get(REFERENCE_DIR)
    if shared is None:
        return compute(), True
    path = Path(shared) / f"{key}.npz"
    computed = False
    with open(Path(shared) / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for this one, then loads it
        if not path.exists():
            arrays, computed = compute(), True
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
    with np.load(path) as f:
        return {name: f[name] for name in f.files}, computed


@functools.cache
def _reference_run(cfg: Config, steps: int, groups: int = 1):
    """`_compute_reference`, computed once per test session (`_once_per_session`)."""

    def compute():
        init, losses, norms, params = _compute_reference(cfg, steps, groups)
        arrays = {f"init{i}": x for i, x in enumerate(jax.tree.leaves(init))}
        arrays |= {f"params{i}": x for i, x in enumerate(jax.tree.leaves(params))}
        return dict(losses=losses, norms=norms, **arrays)

    key = hashlib.sha256(repr((cfg, steps, groups)).encode()).hexdigest()[:24]
    f, _ = _once_per_session(key, compute)
    treedef = jax.tree.structure(GPTModel(cfg.model, seed=cfg.train.seed).abstract_params())
    n = treedef.num_leaves
    init = jax.tree.unflatten(treedef, [f[f"init{i}"] for i in range(n)])
    params = jax.tree.unflatten(treedef, [f[f"params{i}"] for i in range(n)])
    return init, f["losses"], f["norms"], params


def _compute_reference(cfg: Config, steps: int, groups: int):
    model = GPTModel(cfg.model, seed=cfg.train.seed)
    loss_fn = grouped_loss(model, groups)
    tx = plain_optax(cfg, model)
    device = jax.devices()[0]
    params = jax.jit(model.init, out_shardings=SingleDeviceSharding(device))()  # jit(device=) is deprecated
    # Committed to the device like the step's outputs, so every call of `step` hits its first compile.
    opt_state = jax.device_put(tx.init(params), device)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
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


def init_state(run: Run) -> TrainState:
    """`run.init_state()`, whose program is compiled once per test session.

    Fidelity runs that differ only in what the step does (microbatches; ZeRO-1 or ZeRO-2, whose
    states are laid out alike) run the same init program. Its text (lowered, never compiled) and
    the mesh's devices name it: the first run of a program in the session runs it and saves its
    output (`_once_per_session`); a later run of the same program gets that output, bitwise what the
    program makes, put in the same shardings (`run.zero.shardings`, the init's out_shardings).
    """
    text = jax.jit(run.init_state).lower().as_text()
    devices = [d.id for d in run.mesh.devices.flat]
    key = "init-" + hashlib.sha256(repr((text, devices)).encode()).hexdigest()[:24]
    shardings = jax.tree.leaves(run.zero.shardings)
    made = []

    def compute():
        made.append(run.init_state())
        leaves = jax.device_get(jax.tree.leaves(made[0]))
        assert jax.tree.structure(made[0]) == jax.tree.structure(run.zero.shardings)
        # Stored as fp32/int (np.savez cannot store bfloat16); the round trip is exact.
        dtypes = np.array([str(x.dtype) for x in leaves])
        return {"dtypes": dtypes} | {
            f"x{i}": x.astype(np.float32) if x.dtype == jnp.bfloat16 else x for i, x in enumerate(leaves)
        }

    arrays, _ = _once_per_session(key, compute)
    if made:  # this call ran the init itself
        return made[0]
    leaves = [arrays[f"x{i}"].astype(jnp.dtype(dtype)) for i, dtype in enumerate(arrays["dtypes"])]
    return jax.tree.unflatten(jax.tree.structure(run.zero.shardings), jax.device_put(leaves, shardings))


def run_steps(cfg: Config, steps: int = STEPS, devices=None, record: list | None = None):
    """Trains `steps` steps with jzero; returns (run, initial params, losses, norms, state), the params
    (initial, and the state's) read as the params tree (`Zero.full_params`).

    record: if given, each step's metrics (floats) are appended to it."""
    run = setup(cfg, devices)
    state = init_state(run)
    init = jax.device_get(run.zero.full_params(state.params))
    losses, norms = [], []
    for i in range(steps):
        state, m = run.zero.step(state, run.device_batch(i))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        if record is not None:
            record.append({k: float(v) for k, v in m.items()})
    return run, init, np.array(losses), np.array(norms), state._replace(params=run.zero.full_params(state.params))


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
