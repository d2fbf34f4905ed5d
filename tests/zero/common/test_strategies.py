"""The ZeRO layouts: what is sharded, per-device bytes, shardings stable across steps."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import tiny_config
from jzero.mesh import MeshConfig, make_mesh
from jzero.train.loop import setup
from jzero.zero.common.strategies import choose_shard_dim, make_plan
from jzero.zero.config import ShardingStrategy
from jzero.zero.memory import per_device_bytes, shard_bytes


def _moment_bytes(opt_state):
    """Per-device bytes of the per-param optimizer state (scalar step counts excluded)."""
    return per_device_bytes([x for x in jax.tree.leaves(opt_state) if x.ndim])


def _shardings(tree):
    return [x.sharding for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def ddp_bytes():
    run = setup(tiny_config("no_shard", (4, 1, 2)))
    state = run.init_state()
    grads = run.zero.grads(state.params, run.device_batch(0))
    return {"opt": _moment_bytes(state.opt_state), "grads": per_device_bytes(grads)}


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
@pytest.mark.matrix
def test_state_bytes_are_one_over_dp(strategy, ddp_bytes):
    run = setup(tiny_config(strategy, (4, 1, 2)))
    assert run.zero.plan.replicated() == []  # vocab 257 still has a divisible dim (d_model)
    state = run.init_state()
    assert _moment_bytes(state.opt_state) * 4 == ddp_bytes["opt"]
    # The reduced grads are sharded under both (ZeRO-1 reduce-scatters after the last
    # microbatch); the grad buffer they accumulate in is full under ZeRO-1, as in Megatron.
    grads = run.zero.grads(state.params, run.device_batch(0))
    assert per_device_bytes(grads) == ddp_bytes["grads"] // 4
    assert _shardings(grads) == jax.tree.leaves(run.zero.plan.grad_shardings())
    buffer = shard_bytes(run.zero.grad_buffer_structs(jax.numpy.float32))
    assert buffer == (ddp_bytes["grads"] // 4 if strategy == "optim_grads" else ddp_bytes["grads"])


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
@pytest.mark.matrix
def test_shardings_identical_after_init_and_update(strategy):
    run = setup(tiny_config(strategy, (2, 2, 2)))
    state = run.init_state()
    expected = jax.tree.leaves(run.zero.shardings)
    assert _shardings(state) == expected
    state, _ = run.zero.step(state, run.device_batch(0))
    assert _shardings(state) == expected
    dp_axes = ("dp_outer", "dp", "ep")
    for x in jax.tree.leaves(state.opt_state.inner_state):
        if x.ndim:  # moments; scalar step counts are replicated
            spec = x.sharding.spec
            sharded = any(e is not None and dp_axes[-1] in (e if isinstance(e, tuple) else (e,)) for e in spec)
            assert sharded == (strategy != "no_shard")


@pytest.mark.slow
def test_bf16_params_keep_sharded_fp32_main_params():
    run = setup(tiny_config("optim", (8, 1, 1), precision={"param_dtype": "bfloat16"}))
    state = run.init_state()
    main = state.opt_state.main_params
    assert main is not None
    assert {x.dtype for x in jax.tree.leaves(main)} == {jax.numpy.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jax.numpy.dtype("bfloat16")}
    # main params: 4 bytes / 8 ranks; the bf16 model copy is replicated.
    n = sum(x.size for x in jax.tree.leaves(state.params))
    assert per_device_bytes(main) == 4 * n // 8
    assert per_device_bytes(state.params) == 2 * n
    state, m = run.zero.step(state, run.device_batch(0))
    assert jax.numpy.isfinite(m["loss"])


def test_fp32_params_have_no_second_copy():
    run = setup(tiny_config("optim"))
    assert jax.eval_shape(run.init_state).opt_state.main_params is None  # the init traced, not compiled


def test_choose_shard_dim():
    mesh = make_mesh(MeshConfig(dp=4, tp=2))
    assert choose_shard_dim((257, 64), P(), 4, mesh) == 1  # largest divisible dim
    assert choose_shard_dim((64, 256), P(None, "tp"), 4, mesh) == 0  # free of tp
    assert choose_shard_dim((256,), P("tp"), 4, mesh) == 0  # joint tp x dp split
    assert choose_shard_dim((6,), P("tp"), 4, mesh) is None
    assert choose_shard_dim((257,), P(), 1, mesh) is None


def test_replicated_tensors_are_listed():
    mesh = make_mesh(MeshConfig(dp=8))
    params = {"odd": jax.ShapeDtypeStruct((257, 3), "float32"), "even": jax.ShapeDtypeStruct((16,), "float32")}
    specs = {"odd": P(), "even": P()}
    plan = make_plan(mesh, ShardingStrategy.OPTIM, params, specs)
    assert plan.replicated() == [("odd", 257 * 3 * 4)]
    assert make_plan(mesh, ShardingStrategy.NO_SHARD, params, specs).replicated() == []
