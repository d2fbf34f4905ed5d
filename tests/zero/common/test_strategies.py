"""The ZeRO layouts (jzero.zero.common.strategies): what is sharded, per-device bytes, shardings stable across
steps; the plan of a small pytree model per strategy and under HSDP."""

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree, tiny_config
from jzero.errors import ConfigError
from jzero.mesh import DENSE_DP_AXES, MeshConfig, make_mesh
from jzero.train.loop import setup
from jzero.zero.common.strategies import choose_shard_dim, make_plan, path_name, restrict, spec_axes
from jzero.zero.config import OuterStrategy, ShardingStrategy
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
    assert _shardings(grads) == jax.tree.leaves(run.zero.plan.state_shardings())
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
    cfg = tiny_config("optim", (8, 1, 1), precision={"param_dtype": "bfloat16"}, zero={"overlap_grad_reduce": False})
    run = setup(cfg)
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
    assert choose_shard_dim((257, 64), P(), 4, mesh) == 1  # the divisible dim
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


def test_the_major_free_divisible_dim_is_split_else_the_largest():
    """The major dim where it is free and divisible (XLA:GPU's collectives run along it, strategies.py), else
    the largest."""
    mesh = pytree.mesh(dp=4, tp=2)
    assert choose_shard_dim((3, 8, 5), P(), 4, mesh) == 1  # the only dim 4 divides
    assert choose_shard_dim((16, 12), P(), 4, mesh) == 0  # both divide: the major
    assert choose_shard_dim((12, 16), P(), 4, mesh) == 0  # the major, though the smaller
    assert choose_shard_dim((6, 8, 16), P(), 4, mesh) == 2  # the major does not divide: the largest
    assert choose_shard_dim((8, 16), P(None, "tp"), 4, mesh) == 0  # 16 is tp's: not free
    assert choose_shard_dim((16, 8, 12), P("tp"), 4, mesh) == 2  # the major is tp's (2): the largest free
    assert choose_shard_dim((16, 8), P("tp"), 4, pytree.mesh(dp=4, tp=1)) == 0  # tp's, but tp is 1: free
    assert choose_shard_dim((6, 16), P(None, "tp"), 4, mesh) == 1  # no free dim: 16 = 4 x tp 2 x 2, jointly
    assert choose_shard_dim((6, 12), P(None, "tp"), 4, mesh) is None  # 12 is not a multiple of 4 x 2
    assert choose_shard_dim((16, 8), P(), 4, mesh, skip=1) == 1  # a stacked-layer dim never
    assert choose_shard_dim((0, 8), P(), 4, mesh) == 1  # nor an empty one


DP = DENSE_DP_AXES  # the dense DP domain, on a mesh without dp_outer


@pytest.mark.parametrize(
    "strategy, param, grad_buffer, state",
    [
        ("no_shard", P(), P(), P()),
        ("optim", P(), P(), P(DP, None)),
        ("optim_grads", P(), P(DP, None), P(DP, None)),
        ("optim_grads_params", P(DP, None), P(DP, None), P(DP, None)),
    ],
)
def test_what_each_strategy_splits_of_a_pytree_model(strategy, param, grad_buffer, state):
    plan = make_plan(pytree.mesh(dp=4), ShardingStrategy(strategy), pytree.abstract(), pytree.NO_TP)
    t = plan.tensors
    assert {k: t[k].shard_dim for k in t} == {"w": 0, "bias": None, "v": 1, "s": 1}
    w = t["w"]
    assert plan.param_spec(w) == param and plan.state_spec(w) == state
    assert plan.grad_buffer_shardings()["w"].spec == grad_buffer
    assert plan.state_shardings()["w"].spec == state  # the reduced grads are split wherever the state is
    assert plan.state_spec(t["v"]) == (P(None, DP) if strategy != "no_shard" else P())
    assert plan.replicated() == ([] if strategy == "no_shard" else [("bias", 4 * 6)])


@pytest.mark.parametrize("outer, shard_axes", [("no_shard", ("dp", "ep")), ("optim", ("dp", "ep", "dp_outer"))])
def test_hsdp_splits_the_state_over_the_inner_axes_then_across_dp_outer(outer, shard_axes):
    mesh = pytree.mesh(dp=2, dp_outer=2)
    plan = make_plan(mesh, ShardingStrategy.OPTIM_GRADS_PARAMS, pytree.abstract(), pytree.NO_TP, outer_strategy=outer)
    assert plan.outer_strategy == OuterStrategy(outer) and plan.hsdp
    w = plan.tensors["w"]
    assert (w.dp_axes, w.inner_axes, w.shard_axes) == (DP, ("dp", "ep"), shard_axes)
    assert plan.param_spec(w) == P(("dp", "ep"), None)  # ZeRO-3's params: the inner axes only
    assert plan.state_spec(w) == P(shard_axes, None)
    assert plan.dense_shard_axes() == shard_axes
    # bias [6]: 6 divides the inner size 2, not 4 (inner x dp_outer): replicated only under optim.
    assert (plan.tensors["bias"].shard_dim is None) == (outer == "optim")


def test_tp_local_numel_and_the_owner_of_a_state_leaf():
    plan = make_plan(pytree.mesh(dp=2, tp=2), ShardingStrategy.OPTIM, pytree.abstract(), pytree.TP_SPECS)
    # w, bias and v split over tp 2; s replicated over it.
    assert plan.numel_by_domain() == {DP: 16 * 6 // 2 + 6 // 2 + 6 * 12 // 2 + 3 * 8 * 5}
    assert plan.tp_local_numel() == sum(plan.numel_by_domain().values())
    state = optax.adam(1e-3).init(pytree.init_params())
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        owner = plan.param_of(tuple(path))
        name = path_name(path)
        assert (owner is None) == name.endswith("count") and (owner is None or name.endswith(path_name(owner)))
    assert plan.index(tuple(jax.tree_util.tree_flatten_with_path(pytree.abstract())[0][3][0])) == 3
    assert spec_axes(P(("dp", "ep"), None, "tp")) == ("dp", "ep", "tp")
    assert restrict(P(("dp", "tp"), "tp", None), ("dp", "ep")) == P("dp", None, None)


def test_an_expert_flag_must_match_the_ep_split():
    mesh = pytree.mesh(dp=2, ep=2)
    is_expert = {k: k == "w" for k in pytree.SHAPES}
    with pytest.raises(ConfigError, match=r"^param w: is_expert=True but its spec P\(\) does not split it over 'ep'"):
        make_plan(mesh, ShardingStrategy.OPTIM, pytree.abstract(), pytree.NO_TP, is_expert)
