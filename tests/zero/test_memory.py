"""jzero.zero.memory: Megatron's per-device formula is the bytes a built Zero's state holds, and the share
`zero.offload_fraction` puts in host memory is the bytes of the state's pinned_host arrays."""

import jax
import jax.numpy as jnp
import pytest

from helpers import pytree
from jzero.zero.memory import formula_bytes, formula_domains, formula_host, formula_split, per_device_bytes, shard_bytes

DP = 2  # every dim the plan splits divides 2, so no tensor stays replicated and the formula is exact


def moments(state) -> list:
    return [x for x in jax.tree.leaves(state.opt_state.inner_state) if x.ndim]  # the step count is no moment


@pytest.mark.parametrize("strategy", ["optim_grads", "no_shard", "optim", "optim_grads_params"])
@pytest.mark.matrix
def test_formula_is_the_bytes_of_the_built_state(strategy):
    z = pytree.build(strategy, dp=DP, dtype=jnp.bfloat16)  # bf16 params: fp32 main params are kept
    assert z.plan.replicated() == []
    state = z.init_state(lambda: pytree.init_params(dtype=jnp.bfloat16))
    f = formula_split(z)
    assert f["params"] == per_device_bytes(state.params) == shard_bytes(state.params)
    assert f["main_params"] == per_device_bytes(state.opt_state.main_params)
    assert f["optimizer_moments"] == per_device_bytes(moments(state))
    assert f["grads"] == shard_bytes(z.grad_buffer_structs())
    assert formula_bytes(z) == {
        "params": f["params"],
        "grads": f["grads"],
        "optimizer_state": f["main_params"] + f["optimizer_moments"],
    }
    (dense,) = formula_domains(z).values()
    numel = sum(x.size for x in jax.tree.leaves(state.params))
    assert dense["numel"] == numel and dense["d"] == DP
    ddp = formula_split(z, ddp=True)  # nothing divided: 2 + 4 + 8 + 4 bytes per param
    assert (ddp["params"], ddp["main_params"], ddp["optimizer_moments"], ddp["grads"]) == (
        2 * numel, 4 * numel, 8 * numel, 4 * numel,
    )  # fmt: skip


def test_formula_host_is_the_bytes_of_the_offloaded_arrays():
    z = pytree.build("optim", dp=DP, dtype=jnp.bfloat16, zero={"offload_fraction": 1.0})
    state = z.init_state(lambda: pytree.init_params(dtype=jnp.bfloat16))
    on_host = [x for x in jax.tree.leaves(state.opt_state) if x.sharding.memory_kind == "pinned_host"]
    host = formula_host(z)
    f = formula_split(z)
    assert host == {"main_params": f["main_params"], "optimizer_moments": f["optimizer_moments"]}
    assert per_device_bytes(on_host) == host["main_params"] + host["optimizer_moments"]
