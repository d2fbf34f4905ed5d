"""The public API with a user's own model and loss (no jzero model, config or CLI involved)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import clip_by_global_norm
from jzero.mesh import MeshConfig, make_mesh
from jzero.zero import build_zero, groups
from jzero.zero.config import ShardingStrategy, ZeroConfig, ZeroPath


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    w1, w2 = jax.random.normal(k1, (12, 64)) * 0.3, jax.random.normal(k2, (64, 1)) * 0.1
    return {"w1": w1, "b1": jnp.zeros(64), "w2": w2}


def loss_fn(params, batch, tp_axis=None):  # batch [B, 13]: 12 features + target
    """w1 column-parallel, w2 row-parallel: on the flat path (tp-local params) the row-parallel
    output is summed over `tp_axis`, as Megatron's row-parallel layer does."""
    x, y = batch[:, :12], batch[:, 12:]
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = h @ params["w2"]
    if tp_axis is not None:
        out = jax.lax.psum(out, tp_axis)
    return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize("path", [ZeroPath.SPEC, ZeroPath.FLAT], ids=lambda p: p.value)
def test_user_model_with_any_optax_chain_matches_plain_optax(path):
    mesh = make_mesh(MeshConfig(dp=4, tp=2))
    tp_specs = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
    abstract = jax.eval_shape(init_params)
    tx = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, momentum=0.9))
    zero = ZeroConfig(strategy=ShardingStrategy.OPTIM_GRADS, path=path)
    z = build_zero(loss_fn, tx, mesh, abstract, tp_specs, zero, clip_grad=0.5, microbatches=2)
    state = z.init_state(init_params)
    step = z.step
    if path == ZeroPath.SPEC:
        assert state.opt_state.inner_state[1][0].trace["w1"].sharding.spec == P(("dp_outer", "dp", "ep"), "tp")

    params, opt = init_params(), tx.init(init_params())
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = rng.standard_normal((16, 13)).astype(np.float32)
        state, m = step(state, jax.device_put(batch, z.batch_sharding))
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        g, _ = clip_by_global_norm(g, 0.5)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    got = z.full_params(state.params)  # the params tree (the flat path's rest as bucket shards)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(params[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", [ZeroPath.SPEC, ZeroPath.FLAT], ids=lambda p: p.value)
def test_readme_param_groups_are_masked_weight_decay(path):
    """The README's example: jzero's groups.adamw with Megatron's default groups trains exactly
    like plain optax.adamw masked to params of 2 or more dims, on both paths."""
    mesh = make_mesh(MeshConfig(dp=4, tp=2))
    tp_specs = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
    abstract = jax.eval_shape(init_params)
    lr = optax.cosine_decay_schedule(3e-2, 10)
    zero = build_zero(
        loss_fn, groups.adamw(lr, weight_decay=0.5), mesh, abstract, tp_specs,
        ZeroConfig(ShardingStrategy.OPTIM_GRADS, path), groups=groups.param_groups(abstract), clip_grad=1.0,
    )  # fmt: skip
    state = zero.init_state(init_params)
    tx = optax.adamw(lr, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    params, opt = init_params(), tx.init(init_params())
    rng = np.random.default_rng(1)
    for _ in range(6):
        batch = rng.standard_normal((16, 13)).astype(np.float32)
        state, m = zero.step(state, jax.device_put(batch, zero.batch_sharding))
        g, _ = clip_by_global_norm(jax.grad(loss_fn)(params, batch), 1.0)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
    got = zero.full_params(state.params)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(params[k]), rtol=1e-5, atol=1e-6)
    # b1 (1-D) was not decayed: the same run with decay everywhere ends elsewhere.
    decayed = optax.adamw(lr, weight_decay=0.5)
    p2, o2 = init_params(), decayed.init(init_params())
    rng = np.random.default_rng(1)
    for _ in range(6):
        batch = rng.standard_normal((16, 13)).astype(np.float32)
        g, _ = clip_by_global_norm(jax.grad(loss_fn)(p2, batch), 1.0)
        u, o2 = decayed.update(g, o2, p2)
        p2 = optax.apply_updates(p2, u)
    assert np.abs(np.asarray(got["b1"]) - np.asarray(p2["b1"])).max() > 1e-4


def test_the_documented_imports_import():
    """Every `from jzero... import ...` line of the README's and docs/' examples names what jzero has."""
    root = Path(__file__).resolve().parents[2]
    seen = 0
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line in page.read_text().splitlines():
            if re.fullmatch(r"\s*(from jzero[\w.]* import [\w, ]+|import jzero[\w.]*)\s*(#.*)?", line):
                exec(line.split("#")[0].strip(), {})  # an ImportError names the page's stale import
                seen += 1
    assert seen >= 4
