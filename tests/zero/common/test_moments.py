"""jzero.zero.common.moments: `store_state_in` keeps the floating non-scalar state in bf16 between steps and
does the math in fp32: an update is the fp32 update from the upcast state, rounded back."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from helpers import pytree
from jzero.zero.common import groups as groups_lib
from jzero.zero.common.groups import GroupValues
from jzero.zero.common.moments import store_state_in


def test_the_state_is_stored_in_bf16_and_stepped_in_fp32():
    inner = optax.adam(1e-2)
    tx = store_state_in(inner, jnp.bfloat16)
    params = pytree.init_params()
    g = jax.grad(pytree.loss)(params, pytree.batch())
    state = tx.init(params)
    assert {x.dtype for x in jax.tree.leaves(state[0].mu)} == {jnp.dtype(jnp.bfloat16)}
    assert state[0].count.dtype == jnp.int32  # scalars keep their dtype
    for _ in range(2):
        upcast = jax.tree.map(lambda x: x.astype(jnp.float32) if x.ndim else x, state)
        want_updates, want_state = inner.update(g, upcast, params)
        updates, state = tx.update(g, state, params)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates)):
            assert a.dtype == jnp.float32
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
            np.testing.assert_array_equal(a, b.astype(jnp.bfloat16) if b.ndim else b)  # round to nearest even
        params = optax.apply_updates(params, updates)


def test_param_groups_reach_the_wrapped_transformation():
    tx = store_state_in(groups_lib.adamw(1e-2, weight_decay=0.1), jnp.bfloat16)
    params = pytree.init_params()
    g = jax.grad(pytree.loss)(params, pytree.batch())
    lr = {k: 0.0 if k == "v" else 1.0 for k in params}
    updates, _ = tx.update(g, tx.init(params), params, param_groups=GroupValues(lr, jax.tree.map(lambda _: 1.0, lr)))
    assert not np.any(np.asarray(updates["v"])) and np.all(np.abs(np.asarray(updates["w"])) > 0)
