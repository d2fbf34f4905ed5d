"""The Megatron-Core 0.16.1 fixtures in tests/data/megatron (see its README): the MLP Megatron trained,
its batches and hyperparameters, and jzero runs of it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jzero.interop.megatron import Hyperparams
from jzero.mesh import MeshConfig, make_mesh
from jzero.zero import ParamGroup, Zero, build_zero, groups
from jzero.zero.config import ShardingStrategy, ZeroConfig, ZeroPath

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron"
VARIANTS = {"single_bucket": None, "bucket1000": 1000}  # Megatron's bucket_size
BF16 = "bf16_bucket1000"  # bf16 params, fp32 main params: its checkpoints only (tests/data/megatron/README.md)
FORMATS = {"legacy": "ckpt_legacy", "torch_dist": "ckpt_torch_dist_dp_reshardable"}
ORDER = ("fc1.weight", "fc1.bias", "scale.weight", "fc2.weight", "fc2.bias", "fc3.weight")  # registration
# A dict whose leaves (sorted keys: fc1.bias first) are not in Megatron's registration order.
NAMES = {
    "fc1": {"weight": "fc1.weight", "bias": "fc1.bias"},
    "scale": {"weight": "scale.weight"},
    "fc2": {"weight": "fc2.weight", "bias": "fc2.bias"},
    "fc3": {"weight": "fc3.weight"},
}
LR, WEIGHT_DECAY, B1, B2, EPS, CLIP = 1e-2, 0.1, 0.9, 0.95, 1e-8, 1.0
CHECKPOINT_STEP, GLOBAL_BATCH = 10, 16
# Megatron's scheduler of the fixtures: constant lr and weight decay over 10**6 samples (62500 x 16).
HYPERPARAMS = Hyperparams(
    lr=LR, weight_decay=WEIGHT_DECAY, b1=B1, b2=B2, eps=EPS, decay_iters=62500, global_batch=GLOBAL_BATCH
)


@functools.cache
def inputs() -> dict[str, np.ndarray]:
    with np.load(DATA / "inputs.npz") as f:
        return {k: f[k] for k in f.files}


def checkpoint(variant: str, fmt: str) -> Path:
    return DATA / variant / FORMATS[fmt]


def trace(variant: str, continued: bool = False) -> list[dict]:
    return json.loads((DATA / variant / ("trace_continue.json" if continued else "trace.json")).read_text())


def final_params(variant: str, continued: bool = False) -> dict[str, np.ndarray]:
    with np.load(DATA / variant / ("final_params_continue.npz" if continued else "final_params.npz")) as f:
        return {k: f[k] for k in f.files}


def rank_shards(variant: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(DATA / variant / f"rank{rank}_shards.npz") as f:
        return {k: f[k] for k in f.files}


def layout(variant: str) -> dict:
    return json.loads((DATA / variant / "layout.json").read_text())


def tree(by_name: dict[str, np.ndarray]):
    """Arrays by Megatron name, shaped like NAMES."""
    return jax.tree.map(lambda n: by_name[n], NAMES)


def by_name(params) -> dict[str, np.ndarray]:
    """Inverse of `tree`: the arrays of a NAMES-shaped tree by Megatron name."""
    return {n: np.asarray(x) for n, x in zip(jax.tree.leaves(NAMES), jax.tree.leaves(params))}


def init_params():
    return tree({n: inputs()[f"init/{n}"] for n in ORDER})


def init_state(zero: Zero, registration_order=False):
    params = [inputs()[f"init/{n}"] for n in ORDER] if registration_order else init_params()
    return zero.init_state(lambda: jax.tree.map(jnp.asarray, params))


def loss_fn(p, batch):
    """Megatron's forward and the mean squared error (the fixtures' README); `p` shaped like NAMES, or a
    list in registration order (`build(..., registration_order=True)`)."""
    if isinstance(p, list):
        p = tree(dict(zip(ORDER, p)))
    h = jnp.tanh(batch["x"] @ p["fc1"]["weight"].T + p["fc1"]["bias"]) * p["scale"]["weight"]
    h = jnp.tanh(h @ p["fc2"]["weight"].T + p["fc2"]["bias"])
    return jnp.mean(jnp.square(h @ p["fc3"]["weight"].T - batch["t"]))


def build(
    variant: str | None,
    strategy: str = "optim",
    path: str = "flat",
    dp: int = 4,
    registration_order=False,
    dtype=jnp.float32,
    tx=None,
) -> Zero:
    """The fixtures' run in jzero: AdamW (or `tx`) with Megatron's param groups and clipping, on `dp` devices.

    Params shaped like NAMES (jzero's leaves order is not Megatron's), or with `registration_order` a
    list in Megatron's order: jzero's flat buffer is then laid out exactly as Megatron's. `variant`
    picks the bucket size (None: one bucket)."""
    params = [inputs()[f"init/{n}"] for n in ORDER] if registration_order else init_params()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)
    mesh = make_mesh(MeshConfig(dp=dp), jax.devices()[:dp])
    if tx is None:
        tx = groups.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY)
    config = ZeroConfig(ShardingStrategy(strategy), ZeroPath(path), bucket_size=VARIANTS.get(variant))
    specs = jax.tree.map(lambda _: P(), abstract)
    # Megatron's param groups by its names (no decay on biases and 1-D params), whatever the tree
    ndims = [len(x.shape) for x in jax.tree.leaves(abstract)]
    decay = jax.tree.unflatten(jax.tree.structure(abstract), [ParamGroup(wd_mult=float(n >= 2)) for n in ndims])
    return build_zero(loss_fn, tx, mesh, abstract, specs, config, groups=decay, clip_grad=CLIP)


def batch(zero: Zero, step: int):
    """The global batch of 1-based `step`, split over the DP ranks as Megatron splits it."""
    x = inputs()
    return jax.device_put({"x": x["x"][step - 1], "t": x["t"][step - 1]}, zero.batch_sharding)


def train(zero: Zero, state, first: int, last: int):
    """Steps first..last (1-based) from `state`: (state, losses, grad norms)."""
    losses, norms = [], []
    for step in range(first, last + 1):
        state, m = zero.step(state, batch(zero, step))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return state, np.array(losses), np.array(norms)


# tests/data/megatron/gpt/{tp2pp2,moe_ep2} (make_parallel_fixtures.py): jzero's model.* of each run, the
# (tensor, pipeline, expert) sizes that wrote it, its clip and global batch, and the checkpoint's step.
PARALLEL_GPT = DATA / "gpt"
PARALLEL_DENSE = dict(vocab_size=64, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=32, seq_len=16, mlp="swiglu",
             norm="rmsnorm", bias=False, pos="rope")  # fmt: skip
PARALLEL_MODELS = {
    "tp2pp2/untied": {**PARALLEL_DENSE, "tie_embeddings": False},
    "tp2pp2/tied": {**PARALLEL_DENSE, "tie_embeddings": True},
    "moe_ep2": {**PARALLEL_DENSE, "n_layers": 2, "d_ff": 16, "tie_embeddings": False,
                "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": None, "aux_loss_coef": 0.0}},
}  # fmt: skip
PARALLEL = {"tp2pp2/untied": (2, 2, 1), "tp2pp2/tied": (2, 2, 1), "moe_ep2": (1, 1, 2)}
PARALLEL_CLIP = {"tp2pp2/untied": 0.5, "tp2pp2/tied": 0.5, "moe_ep2": 0.4}
PARALLEL_GLOBAL_BATCH = {"tp2pp2/untied": 8, "tp2pp2/tied": 8, "moe_ep2": 16}
PARALLEL_STEP = 10
