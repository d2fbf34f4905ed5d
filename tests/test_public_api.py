"""The public API with a user's own model and loss (no jzero model, config or CLI involved)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jzero.config import MeshConfig, ShardingStrategy
from jzero.mesh import make_mesh
from jzero.zero.optimizer import clip_by_global_norm, state_shardings, zero_optimizer
from jzero.zero.step import batch_sharding, build_train_step, init_train_state, train_state_shardings
from jzero.zero.strategies import make_plan


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (12, 64)) * 0.3, "b1": jnp.zeros(64), "w2": jax.random.normal(k2, (64, 1)) * 0.1}


def loss_fn(params, batch):  # batch [B, 13]: 12 features + target
    x, y = batch[:, :12], batch[:, 12:]
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def test_user_model_with_any_optax_chain_matches_plain_optax():
    mesh = make_mesh(MeshConfig(dp=4, tp=2))
    tp_specs = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
    abstract = jax.eval_shape(init_params)
    plan = make_plan(mesh, ShardingStrategy.OPTIM_GRADS, abstract, tp_specs)
    tx = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, momentum=0.9))
    zopt = zero_optimizer(tx, plan, clip_grad=0.5)
    shardings = train_state_shardings(plan, state_shardings(tx, plan, abstract))
    state = init_train_state(init_params, zopt.init, shardings)
    step = build_train_step(loss_fn, zopt, plan, shardings, microbatches=2)
    assert state.opt_state.inner_state[1][0].trace["w1"].sharding.spec == P(("dp_outer", "dp", "ep"), "tp")

    params, opt = init_params(), tx.init(init_params())
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = rng.standard_normal((16, 13)).astype(np.float32)
        state, m = step(state, jax.device_put(batch, batch_sharding(mesh)))
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        g, _ = clip_by_global_norm(g, 0.5)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(params[k]), rtol=1e-5, atol=1e-6)
