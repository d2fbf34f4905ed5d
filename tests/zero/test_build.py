"""jzero.zero.build: `build_zero` resolves a run once; the `Zero` it returns carries its config and options,
births the state in its shardings, and converts the flat path's state to the spec path's layout and back."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.errors import ConfigError
from jzero.mesh import BATCH_AXES
from jzero.zero.build import Zero, build_zero, check_empty_params
from jzero.zero.common.state import ModelState
from jzero.zero.config import DynamicLossScale, StepOptions, ZeroConfig


def test_zero_carries_its_config_and_options():
    z = pytree.build("optim", "flat", microbatches=2, clip_grad=0.5, grad_reduce_dtype=jnp.bfloat16)
    assert isinstance(z, Zero)
    assert z.config == ZeroConfig("optim", "flat")
    assert z.options == StepOptions(2, np.dtype(jnp.bfloat16), 0.5, None, False)
    assert z.flat is not None and z.flat.plan is z.plan and z.mesh is z.plan.mesh
    assert z.batch_sharding.spec == P(BATCH_AXES)
    assert not z.keeps_main_params  # fp32 params are the main params (Megatron keeps no second copy)
    assert pytree.build("optim", dtype=jnp.bfloat16).keeps_main_params


def test_float16_params_need_loss_scaling():
    mesh, abstract = pytree.mesh(dp=2), pytree.abstract(jnp.float16)
    message = r"^float16 params need loss scaling .*: pass loss_scale=jzero\.zero\.DynamicLossScale\(\) to build_zero$"
    with pytest.raises(ConfigError, match=message):
        build_zero(pytree.loss, optax.adam(1e-2), mesh, abstract, pytree.NO_TP)
    z = pytree.build(dtype=jnp.float16, loss_scale=DynamicLossScale())
    assert z.options.loss_scale == DynamicLossScale()


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_a_non_float_param_is_refused(dtype):
    """The spec path took an int counter among the params, kept an fp32 main copy of it and weight-decayed
    it (30 -> 12 in 3 steps); the owned path crashed in its backward."""
    abstract = {**pytree.abstract(), "count": jax.ShapeDtypeStruct((), dtype)}
    name = jnp.dtype(dtype).name
    with pytest.raises(ConfigError, match=rf"^param \['count'\] is {name}: a ZeRO step trains floating-point"):
        build_zero(pytree.loss, optax.adamw(1e-2), pytree.mesh(dp=2), abstract, {**pytree.NO_TP, "count": P()})


@pytest.mark.parametrize("path", ["spec", "flat", "owned"])
def test_optax_lookahead_is_refused_when_built(path, caplog):
    """Before: AttributeError "'dict' object has no attribute 'fast'" from inside the build's probe, or with params
    wrapped as optax.LookaheadParams a pytree structure error; lookahead updates (fast, slow) params the step
    cannot hand it. Told by the LookaheadState its init makes, wherever in the chain; lookahead's absl warning
    about params without `fast` is not logged beside the refusal."""
    lookahead = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)

    def refused(what: str) -> str:
        return "^" + re.escape(
            f"{what} cannot run in a ZeRO step: optax.lookahead needs its params wrapped as optax.LookaheadParams("
            "fast, slow) and returns updates for both, while the step passes the optimizer the plain params and "
            "applies its updates to them; use lookahead's fast optimizer alone"
        ) + "$"

    mesh, zero, named = pytree.mesh(dp=2), ZeroConfig("optim", path), "lookahead(chain(scale_by_adam, scale))"
    with pytest.raises(ConfigError, match=refused(named)):
        build_zero(pytree.loss, lookahead, mesh, pytree.abstract(), pytree.NO_TP, zero)
    with pytest.raises(ConfigError, match=refused(f"chain(clip, {named})")):
        build_zero(pytree.loss, optax.chain(optax.clip(1.0), lookahead), mesh, pytree.abstract(), pytree.NO_TP, zero)
    wrapped, wrapped_tp = (optax.LookaheadParams.init_synced(t) for t in (pytree.abstract(), pytree.NO_TP))
    with pytest.raises(ConfigError, match=refused(named)):
        build_zero(lambda p, b: pytree.loss(p.fast, b), lookahead, mesh, wrapped, wrapped_tp, zero)
    assert not [r for r in caplog.records if "no attribute `fast`" in r.getMessage()]


@pytest.mark.parametrize("path", ["spec", "flat", "owned"])
def test_a_python_scalar_param_trains_as_plain_optax(path):
    """A Python float among the params (optax takes one) crashed init_state on the spec and flat paths."""

    def init():
        return {**pytree.init_params(), "t": 1.5}

    def loss(params, batch, tp_axis=None):
        return params["t"] * pytree.loss({k: v for k, v in params.items() if k != "t"}, batch)

    z = build_zero(loss, optax.adam(1e-2), pytree.mesh(dp=4), jax.eval_shape(init), {**pytree.NO_TP, "t": P()},
                   ZeroConfig("optim_grads", path))  # fmt: skip
    state = z.init_state(init)
    params, opt_state, tx = init(), optax.adam(1e-2).init(init()), optax.adam(1e-2)
    for seed in range(2):
        state, _ = z.step(state, jax.device_put(pytree.batch(seed), z.batch_sharding))
        updates, opt_state = tx.update(jax.grad(loss)(params, pytree.batch(seed)), opt_state, params)
        params = optax.apply_updates(params, updates)
    got = z.full_params(state.params)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(params[k]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("spec, match", [
    (P("tp"), r"splits dim 0 of shape \(6,\) over 4 devices, which do not divide 6$"),
    (P(None, "tp"), r"names 2 dims, but its shape \(6,\) has 1$"),
])  # fmt: skip
def test_a_tp_spec_that_does_not_fit_its_param_is_refused(spec, match):
    """Before: JAX's IndivisibleError from inside the spec path's build; the flat path built, floored 6 / 4 and
    failed in init_state on a reshape."""
    for path in ("spec", "flat"):
        with pytest.raises(ConfigError, match=r"^param bias: its spec .*" + match):
            build_zero(pytree.loss, optax.adam(1e-2), pytree.mesh(dp=2, tp=4), pytree.abstract(),
                       {**pytree.TP_SPECS, "bias": spec}, ZeroConfig("optim_grads", path))  # fmt: skip


def test_a_zero_size_param_is_refused_where_jaxlibs_xla_would_crash_on_it():
    """jaxlib 0.11.2's XLA segfaults compiling a step with a 0-size param; 0.10.2 (and this machine's jax)
    trains it (tests/zero/test_optax_contract.py's `empty`)."""
    params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "prefix": jax.ShapeDtypeStruct((0, 3), jnp.float32)}
    with pytest.raises(ConfigError, match=r"^param \['prefix'\] has shape \(0, 3\), 0 elements: jaxlib 0\.11\.2's"):
        check_empty_params(params, "0.11.2")
    check_empty_params(params, "0.10.2")
    check_empty_params({"w": params["w"]}, "0.11.2")


def test_state_is_born_in_its_shardings_and_evaluate_is_the_steps_loss():
    z = pytree.build("optim_grads", "spec")
    state = z.init_state(pytree.init_params)
    assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(z.shardings)
    init = jax.jit(pytree.init_params)()
    for k, x in init.items():
        np.testing.assert_array_equal(state.params[k], x)  # jitted straight into its shardings, bitwise
    batch = pytree.batch()
    want = pytree.loss(init, batch)
    got = z.evaluate(state.params, jax.device_put(batch, z.batch_sharding))
    np.testing.assert_allclose(float(got["loss"]), float(want), rtol=1e-6)
    _, metrics = z.step(state, jax.device_put(batch, z.batch_sharding))
    np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-6)


@pytest.mark.parametrize("path", ["spec", "flat"])
def test_grad_buffer_structs_are_the_plans_grad_buffer(path):
    z = pytree.build("optim_grads", path, grad_reduce_dtype=jnp.bfloat16)
    structs = z.grad_buffer_structs()
    assert {s.dtype for s in jax.tree.leaves(structs)} == {jnp.dtype(jnp.bfloat16)}
    if path == "spec":
        assert {k: s.shape for k, s in structs.items()} == pytree.SHAPES
        assert [s.sharding for s in jax.tree.leaves(structs)] == jax.tree.leaves(z.plan.grad_buffer_shardings())
    else:
        assert [s.shape for s in structs] == z.flat.bucket_shapes()
        assert [s.sharding.spec for s in structs] == z.flat.bucket_specs(sharded=True)
    assert {s.dtype for s in jax.tree.leaves(z.grad_buffer_structs(jnp.float32))} == {jnp.dtype(jnp.float32)}


def test_the_flat_state_in_model_space_is_the_spec_paths_and_converts_back_exactly():
    """One step on each path from the same params and batch: the flat path's state, converted to model
    space, is the spec path's (Adam's moments per param); converted back, it is bitwise what it was."""
    batch = pytree.batch()
    states = {}
    for path in ("spec", "flat"):
        z = pytree.build("optim_grads", path, zero={"bucket_size": 64} if path == "flat" else None)
        state, _ = z.step(z.init_state(pytree.init_params), jax.device_put(batch, z.batch_sharding))
        states[path] = (z, state)
    z, flat = states["flat"]
    assert z.flat.n_buckets > 1
    model = jax.jit(z.to_model_space, out_shardings=z.model_opt_shardings)(flat.opt_state)
    spec_state = states["spec"][1].opt_state
    assert jax.tree.structure(model) == jax.tree.structure(spec_state)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(spec_state)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    back = jax.jit(z.from_model_space, out_shardings=z.shardings.opt_state)(model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(flat.opt_state)):
        np.testing.assert_array_equal(a, b)


def _counting_loss(params, batch, model_state, tp_axis=None):
    """pytree's loss plus the state's `shift`; the stats count the rows and sum the targets."""
    stats = {"rows": jnp.float32(batch["y"].shape[0]), "y": batch["y"].sum(axis=0)}
    return pytree.loss(params, batch, tp_axis) + model_state["shift"], {}, stats


COUNTING = ModelState(
    init=lambda: {"shift": jnp.zeros((), jnp.float32), "rows": jnp.zeros((), jnp.float32), "y": jnp.zeros(12)},
    update=lambda s, stats: (
        {"shift": s["shift"] + 1.0, "rows": s["rows"] + stats["rows"], "y": s["y"] + stats["y"]},
        {"rows_seen": s["rows"] + stats["rows"]},
    ),
)


@pytest.mark.parametrize(
    "strategy, path, microbatches, overlap",
    [
        ("optim_grads", "spec", 2, True),
        ("optim", "spec", 2, True),
        ("optim", "spec", 2, False),  # the accumulated (non-overlapped) schedule
        ("no_shard", "spec", 1, False),
        ("optim_grads_params", "spec", 1, True),
        ("optim_grads", "flat", 2, True),
        ("optim", "flat", 1, True),
    ],
)
def test_a_model_state_sees_every_rank_and_micro_batch_once_per_step(strategy, path, microbatches, overlap):
    """The `ModelState` hook: the loss runs with the state the step started with, the stats reach
    `update` summed over the 4 DP ranks and the micro-batches, and the new state is replicated."""
    z = pytree.build(strategy, path, microbatches=microbatches, loss_fn=_counting_loss, model_state=COUNTING,
                     zero={"overlap_grad_reduce": overlap})  # fmt: skip
    state = z.init_state(pytree.init_params)
    assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(z.shardings)
    batches = [pytree.batch(seed) for seed in range(2)]
    for i, batch in enumerate(batches):
        plain = float(pytree.loss(jax.device_get(z.full_params(state.params)), batch))
        state, metrics = z.step(state, jax.device_put(batch, z.batch_sharding))
        np.testing.assert_allclose(float(metrics["loss"]), plain + i, rtol=1e-6)  # the step's old shift
        assert float(metrics["rows_seen"]) == pytree.BATCH * (i + 1)
    assert float(state.model_state["shift"]) == 2.0
    np.testing.assert_allclose(state.model_state["y"], sum(b["y"].sum(axis=0) for b in batches), rtol=1e-5)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.model_state))
    batch = jax.device_put(batches[0], z.batch_sharding)
    plain = float(pytree.loss(jax.device_get(z.full_params(state.params)), batches[0]))
    np.testing.assert_allclose(float(z.evaluate(state.params, batch, state.model_state)["loss"]), plain + 2, rtol=1e-6)
    np.testing.assert_allclose(float(z.evaluate(state.params, batch)["loss"]), plain, rtol=1e-6)  # the initial state
    grads = [z.grads(state.params, batch), z.grads(state.params, batch, state.model_state)]
    assert jax.tree.structure(grads[0]) == jax.tree.structure(grads[1])
