"""The tests' shared helpers (pyproject's `pythonpath` puts tests/ on sys.path: `from helpers import ...`).

This module: the GPT fixtures most tests share: a tiny config, the plain single-device optax
reference, jzero's run of a config, and the check of one against the other
(`assert_matches_reference`, with its `matrix` of cases). Beside it:

    helpers/pytree.py           a small pytree model (a dict of odd-shaped arrays, a tiny loss) for the
                                tests of each jzero/zero module
    helpers/commands.py         `jzero hlo` / `jzero memory` run in-process, on a 1-layer GPT
    helpers/programs.py         small real programs the inspect tests compile (CPU, deviceless H100)
    helpers/megatron_writer.py  Megatron's indexed-dataset writer, transcribed (the fixtures in tests/data)
    helpers/checkpoints.py      a run saved and restored in-process, across stages, paths and meshes
"""

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
import pytest
from jax.sharding import SingleDeviceSharding

from jzero.config import Config, OptimizerName, from_dict, validate
from jzero.mesh import MeshConfig
from jzero.optim import lr_schedule, param_groups
from jzero.train.loop import Run, setup
from jzero.train.model import GPTModel
from jzero.zero.common.groups import ParamGroup
from jzero.zero.common.state import TrainState
from jzero.zero.config import ZeroConfig

STEPS = 5
PATHS = ["spec", "flat"]
MOE = {"num_experts": 4, "top_k": 2, "every": 2, "capacity_factor": 1.0}  # block 1 of 2 is MoE; drops tokens
RANKS = "ranks"  # the reference's vmap axis over one micro-batch's DP ranks (the global aux loss sums over it)
REFERENCE_DIR = "JZERO_TEST_REFERENCES"  # env var: the session's directory of computed references


# What JAX's CUDA plugin writes to a child's stderr on a machine without an NVIDIA driver (before jzero holds it back).
_CUDA_STUB_NOISE = ("All log messages before absl::InitializeLog() is called", "cudart_stub.cc")


def stderr_lines(stderr: str) -> list[str]:
    """A child process's stderr lines, blank ones and the CUDA plugin's import noise dropped."""
    return [line for line in stderr.splitlines() if line.strip() and not any(n in line for n in _CUDA_STUB_NOISE)]


def clip_by_global_norm(grads, max_norm: float | None):
    """The reference's clipping, Megatron's (docs/megatron.md): the grads times min(1, max_norm / (norm + 1e-6)),
    and the norm before clipping; max_norm None: no clipping."""
    norm = optax.tree.norm(grads)
    if max_norm is None:
        return grads, norm
    coeff = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * coeff.astype(g.dtype), grads), norm


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


def flat_config(strategy, mesh=(8, 1, 1), microbatches=1, dp_outer=1, model=None, precision=None, **zero) -> Config:
    """`tiny_config` on the flat path, with `zero` settings, `dp_outer` and a batch 3 micro-batches divide;
    validated."""
    cfg = tiny_config(
        strategy, mesh, microbatches, model=model or {}, zero={"path": "flat", **zero}, precision=precision or {},
        train={"global_batch": 24 if microbatches == 3 else 16},
    )  # fmt: skip
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp_outer=dp_outer))
    validate(cfg)
    return cfg


def plain_optax(cfg: Config, model: GPTModel) -> optax.GradientTransformation:
    """What a user writes in plain optax for `cfg`'s optimizer and param groups: optax's own
    adamw / adam / sgd, or for `optimizer.name: optax` the optax function of that name called with
    the schedule and `optimizer.optax.args`, one per group (its lr x lr_mult, its weight decay x
    wd_mult), by `optax.multi_transform`. jzero's group-aware chain must train to the same numbers."""
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
        if o.name == OptimizerName.OPTAX:  # a bare name, optax's: optax.lion(rate, **args)
            return getattr(optax, o.optax.name)(rate, **o.optax.args)
        return optax.sgd(rate, momentum=o.b1 or None)

    is_group = lambda g: isinstance(g, ParamGroup)  # noqa: E731
    distinct = sorted(set(jax.tree.leaves(groups, is_leaf=is_group)))
    labels = jax.tree.map(lambda g: str(distinct.index(g)), groups, is_leaf=is_group)
    return optax.multi_transform({str(i): make(g) for i, g in enumerate(distinct)}, labels)


def reference_run(cfg: Config, steps: int = STEPS):
    """Plain single-device optax on the same batches: (initial params, losses, grad norms, final params).

    Depends only on model, optimizer, data and seed, never on strategy or path, so one run
    serves every such variant of a config. A dense model's loss is a mean over tokens, the
    same whatever the split; a MoE model routes each rank's microbatch on its own (capacity,
    load-balancing loss), so the reference routes the same groups of rows: the global batch
    in dp_domain_size x microbatches contiguous groups (`jzero.zero.common.batch`), loss averaged; the
    global load-balancing loss sums its expert counts over one micro-batch's ranks (a vmap axis).
    With `model.moe.expert_bias` the reference routes with the bias and moves it after each step by
    Megatron's rule, transcribed here (`megatron_bias_update`), on the tokens per expert of every group.
    """
    return _reference(cfg, steps)[:4]


def reference_model_state(cfg: Config, steps: int = STEPS):
    """The reference's model state after `steps` (`reference_run`): {"expert_bias": [n_moe, E]}, or None."""
    return _reference(cfg, steps)[4]


def _reference(cfg: Config, steps: int):
    groups = (cfg.dp_domain_size, cfg.train.microbatches) if cfg.model.moe.num_experts else (1, 1)
    train = dataclasses.replace(cfg.train, microbatches=1)
    return _reference_run(dataclasses.replace(cfg, mesh=MeshConfig(), zero=ZeroConfig(), train=train), steps, groups)


def megatron_bias_update(bias, tokens_per_expert, rate: float):
    """Megatron-LM's `get_updated_expert_bias` (moe_utils.py), after its all-reduce: average_tokens =
    tokens.sum(-1, keepdim=True) / tokens.shape[-1]; bias + sign(average_tokens - tokens) * rate."""
    average = tokens_per_expert.sum(axis=-1, keepdims=True) / tokens_per_expert.shape[-1]
    return bias + jnp.sign(average - tokens_per_expert) * rate


def grouped_loss(model: GPTModel, groups: tuple[int, int]):
    """The mean of `model.loss` over n_dp x M contiguous groups of the batch's rows (rank-major, as
    `jzero.zero.batch` splits them), each micro-batch's n_dp groups a vmap over `RANKS`."""
    n_dp, microbatches = groups

    def loss(params, batch):
        rows = batch.reshape(n_dp, microbatches, -1, *batch.shape[1:])  # [ranks, M, b, ...]
        per_rank = jax.vmap(lambda r: model.loss(params, r), axis_name=RANKS)  # one micro-batch's ranks
        return jnp.mean(jax.vmap(per_rank, in_axes=1)(rows))

    return loss if n_dp * microbatches > 1 else model.loss


def grouped_loss_with_state(model: GPTModel, groups: tuple[int, int]):
    """`grouped_loss` of `model.loss_with_state`: (params, model_state, batch) -> (mean loss, the
    stats summed over every group)."""
    n_dp, microbatches = groups

    def loss(params, model_state, batch):
        rows = batch.reshape(n_dp, microbatches, -1, *batch.shape[1:])
        one = lambda r: model.loss_with_state(params, r, model_state)  # noqa: E731
        losses, _, stats = jax.vmap(jax.vmap(one, axis_name=RANKS), in_axes=1)(rows)  # [M, ranks]
        return jnp.mean(losses), jax.tree.map(lambda x: x.sum(axis=(0, 1)), stats)

    return loss


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
def _reference_run(cfg: Config, steps: int, groups: tuple[int, int] = (1, 1)):
    """`_compute_reference`, computed once per test session (`_once_per_session`)."""

    def compute():
        init, losses, norms, params, state = _compute_reference(cfg, steps, groups)
        arrays = {f"init{i}": x for i, x in enumerate(jax.tree.leaves(init))}
        arrays |= {f"params{i}": x for i, x in enumerate(jax.tree.leaves(params))}
        arrays |= {f"state{i}": x for i, x in enumerate(jax.tree.leaves(state))}
        return dict(losses=losses, norms=norms, **arrays)

    key = hashlib.sha256(repr((cfg, steps, groups)).encode()).hexdigest()[:24]
    f, _ = _once_per_session(key, compute)
    model = GPTModel(cfg.model, seed=cfg.train.seed)
    treedef = jax.tree.structure(model.abstract_params())
    n = treedef.num_leaves
    init = jax.tree.unflatten(treedef, [f[f"init{i}"] for i in range(n)])
    params = jax.tree.unflatten(treedef, [f[f"params{i}"] for i in range(n)])
    state_def = jax.tree.structure(jax.eval_shape(model.init_state))
    state = jax.tree.unflatten(state_def, [f[f"state{i}"] for i in range(state_def.num_leaves)])
    return init, f["losses"], f["norms"], params, state


def _compute_reference(cfg: Config, steps: int, groups: tuple[int, int]):
    model = GPTModel(cfg.model, seed=cfg.train.seed, dp_axes=(RANKS,) if groups[0] > 1 else ())
    stateful = model.init_state() is not None
    if stateful:
        loss_fn = grouped_loss_with_state(model, groups)
    else:
        plain = grouped_loss(model, groups)
        loss_fn = lambda params, state, batch: (plain(params, batch), {})  # noqa: E731
    tx = plain_optax(cfg, model)
    device = jax.devices()[0]
    params = jax.jit(model.init, out_shardings=SingleDeviceSharding(device))()  # jit(device=) is deprecated
    # Committed to the device like the step's outputs, so every call of `step` hits its first compile.
    opt_state = jax.device_put(tx.init(params), device)

    @jax.jit
    def step(params, opt_state, model_state, batch):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, batch)
        if stateful:
            bias, rate = model_state["expert_bias"], cfg.model.moe.bias_update_rate
            model_state = {"expert_bias": megatron_bias_update(bias, stats["tokens_per_expert"], rate)}
        grads, norm = clip_by_global_norm(grads, cfg.optimizer.clip_grad)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state, loss, norm

    data = setup_free_dataset(cfg)
    init = jax.device_get(params)
    model_state = jax.device_put(model.init_state(), device)
    losses, norms = [], []
    for i in range(steps):
        batch = jax.device_put(data.batch(i), device)
        params, opt_state, model_state, loss, norm = step(params, opt_state, model_state, batch)
        losses.append(float(loss))
        norms.append(float(norm))
    return init, np.array(losses), np.array(norms), jax.device_get(params), jax.device_get(model_state)


def setup_free_dataset(cfg: Config):
    from jzero.train.data import make_dataset

    return make_dataset(cfg)


def init_state(run: Run) -> TrainState:
    """`run.init_state()`, whose program is compiled once per test session.

    Fidelity runs that differ only in what the step does (microbatches; ZeRO-1 or ZeRO-2, whose
    states are laid out alike) run the same init program. Its jaxpr (traced, not lowered: a fifth of
    the time), the values of the constants it closes over and the mesh's devices name it: the first
    run of a program in the session runs it and saves its output (`_once_per_session`); a later run
    of the same program gets that output, bitwise what the program makes, put in the same shardings
    (`run.zero.shardings`, the init's out_shardings).
    """
    closed = jax.jit(run.init_state).trace().jaxpr
    name = hashlib.sha256(repr((str(closed.jaxpr), [d.id for d in run.mesh.devices.flat])).encode())
    for const in closed.consts:
        name.update(np.asarray(const).tobytes())
    key = "init-" + name.hexdigest()[:24]
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


def matrix(meshes) -> list:
    """(strategy, mesh, microbatches, path) cases that run each code path of the step once per mesh
    and path (`jzero/zero/spec/grads.py`, `jzero/zero/flat/layout.py`):

      no_shard x 1: DDP's reduction (all-reduce / psum) and its replicated update;
      optim x 2: the microbatch loop accumulating full local grads (DDP's and ZeRO-1's, laid out
        alike), then ZeRO-1's one reduce-scatter after the last and its sharded update;
      optim_grads x 1, x 2: ZeRO-2's reduction at each microbatch, without and with the loop.

    Left out: no_shard x 2 (the loop of optim x 2, then the reduction and update of no_shard x 1:
    the two strategies differ only in the reduction's output sharding and the state's layout);
    optim x 1 on the spec path (one microbatch's local grads, as no_shard x 1, then the reduction
    and update of optim x 2); optim x 1 on the flat path, which builds the very program of
    optim_grads x 1 (one reduce-scatter, before or after a loop of one).
    """
    cases = [("no_shard", 1), ("optim", 2), ("optim_grads", 1), ("optim_grads", 2)]
    return [
        pytest.param(strategy, mesh, mb, path, id="{}-dp{}-ep{}-tp{}-{}-{}".format(strategy, *mesh, mb, path))
        for strategy, mb in cases
        for mesh in meshes
        for path in PATHS
    ]


def default_codegen() -> bool:
    """Whether XLA:CPU runs its default code generation in this process, not the suite's faster one
    (tests/conftest.py), under which two differently fused programs may round differently in the last bit."""
    return "xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", "")


def assert_matches_reference(cfg, devices=None) -> list[dict]:
    """Trains STEPS steps of `cfg` and checks them against the reference; returns each step's metrics."""
    ref_init, ref_losses, ref_norms, ref_params = reference_run(cfg)
    record = []
    _, init, losses, norms, state = run_steps(cfg, devices=devices, record=record)
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(ref_init)):
        if default_codegen():
            np.testing.assert_array_equal(a, b)  # sharded init is bitwise the unsharded init
        else:  # the suite's faster code generation: bitwise in test_sharded_init_is_bitwise_the_unsharded_init
            np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
    errors = rel_param_errors(state.params, ref_params)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: {errors[worst]:.2e}"
    assert len(losses) == STEPS
    ref_state = reference_model_state(cfg)
    assert jax.tree.structure(jax.device_get(state.model_state)) == jax.tree.structure(ref_state)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.model_state)), jax.tree.leaves(ref_state)):
        np.testing.assert_array_equal(a, b)  # the expert bias: the same counts give the same signs, bitwise
    return record
