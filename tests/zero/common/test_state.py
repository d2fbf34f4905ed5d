"""jzero.zero.common.state: when the state keeps fp32 main params, a loss with or without metrics, and the
train state jitted straight into its shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.zero.common.state import TrainState, ZeroState, init_train_state, keeps_main_params, with_metrics


def test_main_params_are_kept_for_non_fp32_params_or_a_quantized_gather():
    assert not keeps_main_params(pytree.abstract())  # fp32: the params are the main params
    assert keeps_main_params(pytree.abstract(jnp.bfloat16))
    assert keeps_main_params(pytree.abstract(), quantized_gather=True)  # the model copy is then not exact
    mixed = pytree.abstract() | {"bias": jax.ShapeDtypeStruct((6,), jnp.float16)}
    assert keeps_main_params(mixed)


def test_with_metrics_gives_every_loss_the_has_aux_form():
    params, batch = pytree.init_params(), pytree.batch()
    loss, metrics = with_metrics(pytree.loss, has_aux=False)(params, batch)
    assert metrics == {} and float(loss) == float(pytree.loss(params, batch))

    def aux(params, batch):
        return pytree.loss(params, batch), {"w_norm": jnp.linalg.norm(params["w"])}

    assert with_metrics(aux, has_aux=True) is aux


def test_the_train_state_is_born_in_its_shardings():
    mesh = pytree.mesh(dp=4)
    split = {"w": P("dp"), "bias": P(), "v": P(None, "dp"), "s": P()}
    params_sh = {k: NamedSharding(mesh, spec) for k, spec in split.items()}
    tx = optax.sgd(0.1, momentum=0.9)
    opt_sh = ZeroState(None, (optax.TraceState(trace=params_sh), optax.EmptyState()))
    shardings = TrainState(params_sh, opt_sh, NamedSharding(mesh, P()))
    state = init_train_state(pytree.init_params, lambda p: ZeroState(None, tx.init(p)), shardings)
    assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(shardings)
    assert state.step.dtype == jnp.int32 and int(state.step) == 0
    init = jax.jit(pytree.init_params)()
    for k in pytree.SHAPES:
        np.testing.assert_array_equal(state.params[k], init[k])
        np.testing.assert_array_equal(state.opt_state.inner_state[0].trace[k], np.zeros(pytree.SHAPES[k]))
