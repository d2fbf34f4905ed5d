"""The owned layout (`jzero/zero/owned/layout.py`): Muon, Adafactor and AdamW stepped on whole params by their
owners train to plain single-device optax's numbers; the step moves DDP's bytes with no collective in the
update but scalars; its state converts to model space and back; chains that couple params are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import MOE, assert_matches_reference, clip_by_global_norm, pytree, tiny_config
from jzero.errors import ConfigError
from jzero.inspect.hlo import parse_collectives
from jzero.mesh import MeshConfig, make_mesh
from jzero.zero import DynamicLossScale, ZeroConfig, build_zero
from jzero.zero.owned.layout import owned_layout

INNERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "muon": lambda: optax.contrib.muon(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
}
STEPS = 3


def _plain(inner, params, batches, clip=None):
    """Plain single-device optax, with Megatron's clipping on the global norm when `clip`."""
    state = inner.init(params)
    for b in batches:
        grads, _ = clip_by_global_norm(jax.grad(pytree.loss)(params, b), clip)
        updates, state = inner.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _train(zero, batches):
    state = zero.init_state(pytree.init_params)
    for b in batches:
        state, metrics = zero.step(state, b)
    return state, metrics


@pytest.mark.parametrize(
    "inner, dp, strategy, microbatches",
    [
        ("muon", 4, "optim_grads", 2),
        ("adamw", 2, "optim", 1),
        ("adafactor", 8, "optim_grads", 1),
        ("muon", 8, "optim", 2),
        ("adamw", 4, "optim_grads", 2),
        ("adafactor", 2, "optim", 2),
    ],
)
@pytest.mark.matrix
def test_matches_plain_optax(inner, dp, strategy, microbatches):
    batches = [pytree.batch(seed) for seed in range(STEPS)]
    zero = pytree.build(strategy, "owned", dp=dp, inner=INNERS[inner](), microbatches=microbatches, clip_grad=0.5)
    state, _ = _train(zero, batches)
    want = _plain(INNERS[inner](), pytree.init_params(), batches, clip=0.5)
    for name in want:
        np.testing.assert_allclose(state.params[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name)


def test_reduce_in_parts_is_the_same_step():
    """The grads reach their owners in parts of `zero.bucket_size` / d elements per owner: the same numbers."""
    batches = [pytree.batch(seed) for seed in range(2)]
    states = [
        _train(pytree.build("optim_grads", "owned", dp=4, microbatches=2, zero=zero), batches)[0]
        for zero in ({}, {"bucket_size": 28})
    ]
    for a, b in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
        np.testing.assert_array_equal(a, b)


def test_bf16_params_match_the_spec_layout():
    """bf16 params, fp32 main params per owner: the same step as the spec layout's ZeRO-2, to fp32 rounding."""
    batches = [pytree.batch(seed) for seed in range(STEPS)]
    runs = {}
    for path in ("spec", "owned"):
        zero = pytree.build(
            "optim_grads", path, dp=4, inner=optax.adamw(1e-2, weight_decay=0.1), dtype=jnp.bfloat16, clip_grad=1.0
        )
        state = zero.init_state(lambda: pytree.init_params(dtype=jnp.bfloat16))
        for b in batches:
            state, metrics = zero.step(state, b)
        runs[path] = (zero.to_model_space(state.opt_state), metrics)
    spec, owned = runs["spec"], runs["owned"]
    np.testing.assert_allclose(owned[1]["grad_norm"], spec[1]["grad_norm"], rtol=1e-6)
    for name in spec[0].main_params:
        np.testing.assert_allclose(owned[0].main_params[name], spec[0].main_params[name], rtol=1e-6, atol=1e-7)


def test_loss_scaling_skips_as_the_spec_layout():
    """fp16 params: the first steps overflow at the initial scale and are skipped, as on the spec layout."""
    batches = [pytree.batch(seed) for seed in range(3)]
    out = {}
    for path in ("spec", "owned"):
        zero = pytree.build(
            "optim", path, dp=2, dtype=jnp.float16, loss_scale=DynamicLossScale(initial_loss_scale=2.0**20)
        )
        state = zero.init_state(lambda: pytree.init_params(dtype=jnp.float16))
        skipped = []
        for b in batches:
            state, metrics = zero.step(state, b)
            skipped.append(float(metrics["skipped"]))
        out[path] = (skipped, state.params)
    assert out["owned"][0] == out["spec"][0] and 1.0 in out["owned"][0]
    for name in out["spec"][1]:
        np.testing.assert_allclose(np.float32(out["owned"][1][name]), np.float32(out["spec"][1][name]), rtol=1e-3)


def test_model_space_round_trip_and_resume_onto_spec():
    """to_model_space gives the spec layout's state (same steps, to rounding); from_model_space inverts it
    bitwise; the spec layout continues from the owned state as from its own."""
    batches = [pytree.batch(seed) for seed in range(3)]
    inner = lambda: optax.adamw(1e-2, weight_decay=0.1)  # noqa: E731
    owned, spec = (pytree.build("optim", path, dp=4, inner=inner()) for path in ("owned", "spec"))
    o_state, _ = _train(owned, batches[:2])
    s_state, _ = _train(spec, batches[:2])
    o_model = jax.jit(owned.to_model_space)(o_state.opt_state)
    s_model = spec.to_model_space(s_state.opt_state)
    for a, b in zip(jax.tree.leaves(o_model), jax.tree.leaves(s_model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    back = jax.jit(owned.from_model_space)(o_model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(o_state.opt_state)):
        np.testing.assert_array_equal(a, b)
    params = jax.tree.map(jnp.copy, o_state.params)  # the spec step donates its state
    moved = s_state._replace(params=params, opt_state=jax.jit(spec.from_model_space)(o_model))
    moved, m_spec = spec.step(jax.device_put(moved, spec.shardings), batches[2])
    _, m_owned = owned.step(o_state, batches[2])
    np.testing.assert_allclose(m_spec["loss"], m_owned["loss"], rtol=1e-6)


def _residual(blocks=8, d=64, f=256):
    """The issue's model, scaled: residual blocks of [d, f] and [f, d] matrices."""
    keys = jax.random.split(jax.random.key(0), 2 * blocks)
    params = {
        f"block{i}": {
            "w1": 0.05 * jax.random.normal(keys[2 * i], (d, f)),
            "w2": 0.05 * jax.random.normal(keys[2 * i + 1], (f, d)),
        }
        for i in range(blocks)
    }

    def loss(params, batch):
        h = batch["x"]
        for i in range(blocks):
            h = h + jnp.tanh(h @ params[f"block{i}"]["w1"]) @ params[f"block{i}"]["w2"]
        return jnp.mean((h - batch["y"]) ** 2)

    batch = {"x": jnp.ones((16, d)), "y": jnp.zeros((16, d))}
    return params, loss, batch


def _wire(strategy, path, inner, dp=8):
    params, loss, batch = _residual()
    mesh = make_mesh(MeshConfig(dp=dp), jax.devices()[:dp])
    zero = build_zero(
        loss,
        inner,
        mesh,
        jax.eval_shape(lambda: params),
        jax.tree.map(lambda _: P(), params),
        ZeroConfig(strategy, path, overlap_grad_reduce=False),
    )
    state = jax.eval_shape(lambda: zero.init_state(lambda: params))
    text = zero.step.lower(state, batch).compile().as_text()
    return parse_collectives(text), sum(x.size for x in jax.tree.leaves(params)) * 4


@pytest.mark.slow
def test_wire_bytes_are_ddps_and_the_update_has_no_collective():
    """Muon owned (ZeRO-1): one reduce-scatter and one all-gather of the owners' segments, DDP's bytes
    (the model's 16 matrices dealt 2 per rank: no padding), and every other collective a scalar."""
    owned, nbytes = _wire("optim", "owned", optax.contrib.muon(1e-2))
    ddp, _ = _wire("no_shard", "spec", optax.contrib.muon(1e-2))
    big = [c for c in owned if c.payload_bytes > 8]
    assert sorted(c.kind for c in big) == ["all-gather", "reduce-scatter"]
    ratio = sum(c.wire_bytes for c in big) / sum(c.wire_bytes for c in ddp if c.payload_bytes > 8)
    assert ratio == pytest.approx(1.0, abs=1e-3)
    assert sum(c.wire_bytes for c in ddp) == pytest.approx(2 * 7 / 8 * nbytes, rel=1e-3)


def test_refuses_a_chain_that_couples_params():
    with pytest.raises(ConfigError, match="differently alone than among all params"):
        pytree.build("optim", "owned", dp=2, inner=optax.chain(optax.clip_by_global_norm(1e-3), optax.adam(1e-2)))


def test_refuses_noise_drawn_for_the_whole_tree():
    """optax.noisy_sgd splits one PRNG key over all the params' leaves: a rank holding some of them draws other
    noise. Its key in the state crashed the probe's comparison of the state's scalars (TypeError) before."""
    with pytest.raises(ConfigError, match="differently alone than among all params"):
        pytree.build("optim", "owned", dp=2, inner=optax.noisy_sgd(0.1, eta=0.01, key=0))


@pytest.mark.parametrize(
    "inner, match",
    [  # both trained wrong on this path before the probe ran past two steps and compared the state's scalars
        (lambda: optax.MultiSteps(optax.apply_if_finite(optax.sgd(0.1), 5), 3), "its owner, and a scalar of Multi"),
        (lambda: optax.contrib.dadapt_adamw(1.0), "a scalar of dadapt_adamw's state differs with param"),
    ],
    ids=["multi-steps-skip-if-nonfinite", "dadapt-adamw"],
)
def test_refuses_a_chain_that_couples_params_after_two_steps(inner, match):
    with pytest.raises(ConfigError, match=match):
        pytree.build("optim", "owned", dp=2, inner=inner())


def test_refuses_a_chain_that_fails_on_a_rank_that_owns_nothing():
    """galore's update fails on a tree of MaskedNodes only: before, the step built and crashed at its first call
    where some rank owned no param."""
    pytree.build("optim", "owned", dp=2, inner=optax.contrib.galore(1e-2, rank=2))
    with pytest.raises(ConfigError, match=r"^zero.path=owned: some of the 8 ranks own no param here, and .*galore"):
        pytree.build("optim", "owned", dp=8, inner=optax.contrib.galore(1e-2, rank=2))


@pytest.mark.parametrize(
    "zero, match",
    [
        ({"strategy": "optim_grads_params"}, "optim or optim_grads"),
        ({"strategy": "no_shard"}, "optim or optim_grads"),
        ({"offload_fraction": 0.5}, "offload_fraction=0"),
    ],
)
def test_refuses_what_it_cannot_run(zero, match):
    with pytest.raises(ConfigError, match=match):
        ZeroConfig(**{"path": "owned", **zero})


def test_layout_is_registered():
    from jzero.zero.build import LAYOUTS
    from jzero.zero.config import ZeroPath

    assert LAYOUTS[ZeroPath.OWNED] is owned_layout


@pytest.mark.parametrize(
    "strategy, mesh, microbatches, model",
    [
        ("optim", (8, 1, 1), 1, {}),
        ("optim_grads", (4, 1, 1), 2, {}),
        ("optim_grads", (4, 2, 1), 1, {"moe": MOE}),
        ("optim", (2, 2, 1), 2, {"moe": MOE}),
    ],
)
@pytest.mark.slow
def test_gpt_matches_single_device_optax(strategy, mesh, microbatches, model):
    """jzero's scanned GPT (its blocks owned by layer) and its MoE (experts over the expert-DP domain)."""
    cfg = tiny_config(strategy, mesh, microbatches, zero={"path": "owned"}, model=model)
    assert_matches_reference(cfg, devices=jax.devices()[: mesh[0] * mesh[1] * mesh[2]])


def test_dataclass_config_keeps_the_balance():
    assert dataclasses.replace(ZeroConfig(path="owned"), owned_balance="megatron").owned_balance == "megatron"


@pytest.mark.slow
def test_orbax_checkpoint_moves_between_owned_and_spec(tmp_path):
    """A checkpoint of the owned layout restores onto the spec layout at another dp, tp and stage, and one of
    the spec layout onto the owned, every saved array (params, moments) in place; training continues."""
    from helpers.checkpoints import restore_matches, train_and_save
    from jzero.train.loop import setup

    one = {"n_layers": 1}  # a checkpoint's arrays move alike whatever the depth
    owned = tiny_config("optim", (8, 1, 1), 1, zero={"path": "owned"}, model=one)
    spec = tiny_config("optim_grads_params", (4, 1, 2), 1, model=one)
    spec_run = setup(spec)  # built once: restored onto, then trained and saved
    whole = train_and_save(tmp_path / "owned", owned)
    restore_matches(tmp_path / "owned", whole, spec, train=True, run=spec_run)
    whole = train_and_save(tmp_path / "spec", spec, run=spec_run)
    restore_matches(
        tmp_path / "spec", whole, dataclasses.replace(owned, zero=ZeroConfig("optim_grads", "owned")), train=True
    )


def test_memory_formula_counts_the_owners_segments():
    """Megatron's formula on the owned layout (`memory.owned_numel_by_domain`): d segments of the largest
    owner's elements, the bytes its built state holds (bf16 params, fp32 main params, ZeRO-2's grads)."""
    from jzero.zero.memory import formula_split, per_device_bytes, shard_bytes

    zero = pytree.build("optim_grads", "owned", dp=2, dtype=jnp.bfloat16)
    state = zero.init_state(lambda: pytree.init_params(dtype=jnp.bfloat16))
    f = formula_split(zero)
    (dom,) = zero.layout.owned.domains
    assert f["main_params"] == per_device_bytes(state.opt_state.main_params) == 4 * dom.size
    assert f["optimizer_moments"] == per_device_bytes([state.opt_state.inner_state["float32"]])  # Adam's mu, nu
    assert f["grads"] == shard_bytes(zero.grad_buffer_structs())
    assert f["params"] == per_device_bytes(state.params)


@pytest.mark.slow
def test_hsdp_and_bf16_moments_match_plain_optax():
    """dp_outer 2 x dp 2: each replica owns the whole model, the segments all-reduced across dp_outer; the
    moments stored in bf16 (`store_state_in`) as on the spec layout."""
    from jzero.zero import store_state_in

    batches = [pytree.batch(seed) for seed in range(STEPS)]
    mesh = pytree.mesh(2, dp_outer=2)
    zero = build_zero(pytree.loss, optax.contrib.muon(1e-2), mesh, pytree.abstract(), pytree.NO_TP,
                      ZeroConfig("optim", "owned"), microbatches=2)  # fmt: skip
    state, _ = _train(zero, batches)
    want = _plain(optax.contrib.muon(1e-2), pytree.init_params(), batches)
    for name in want:
        np.testing.assert_allclose(state.params[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name)
    params = {}
    for path in ("spec", "owned"):
        inner = store_state_in(optax.adamw(1e-2, weight_decay=0.1), jnp.bfloat16)
        params[path] = _train(pytree.build("optim", path, dp=4, inner=inner), batches)[0].params
    for name in params["spec"]:
        np.testing.assert_allclose(params["owned"][name], params["spec"][name], rtol=1e-6, atol=1e-7)


def _stacked(layers: int):
    """A stacked unit param `[L, 8, 6]` (owned by layer) beside a matrix: params, loss, units."""
    keys = jax.random.split(jax.random.key(0), 2)
    params = {"blocks": 0.3 * jax.random.normal(keys[0], (layers, 8, 6)), "w": 0.3 * jax.random.normal(keys[1], (6, 5))}

    def loss(params, batch):
        h = batch["x"][:, :8]
        for i in range(layers):
            h = jnp.tanh(h @ params["blocks"][i]) @ params["blocks"][i].T
        return jnp.mean((jnp.tanh(h @ params["blocks"][0]) @ params["w"] - batch["y"][:, :5]) ** 2)

    return params, loss, {"blocks": 1, "w": None}


@pytest.mark.parametrize("layers", [4, 16])
def test_adafactor_on_a_stack_owns_it_whole(layers):
    """Adafactor couples a stack's layers (its block RMS over the whole param; at 16 layers it also factors
    the layer dim): its owner holds the stack whole, so it trains as plain optax; its factored state goes to
    model space (the spec layout's, to rounding) and back bitwise."""
    params, loss, units = _stacked(layers)
    inner = lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4)  # noqa: E731
    batches = [pytree.batch(seed) for seed in range(2)]
    states = {}
    for path in ("owned", "spec"):
        abstract, specs = jax.eval_shape(lambda: params), jax.tree.map(lambda _: P(), params)
        config = ZeroConfig("optim", path, overlap_grad_reduce=False)  # the loss runs no `unit`
        zero = build_zero(loss, inner(), pytree.mesh(2), abstract, specs, config, units=units)
        state = zero.init_state(lambda: params)
        for b in batches:
            state, _ = zero.step(state, b)
        states[path] = (zero, state)
    zero, state = states["owned"]
    assert zero.layout.owned.stacked == (False, False)
    spec_zero, spec_state = states["spec"]
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(spec_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    model = jax.jit(zero.to_model_space)(state.opt_state)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(spec_zero.to_model_space(spec_state.opt_state))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(jax.jit(zero.from_model_space)(model)), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(a, b)


def test_a_size_rule_beyond_the_miniature_owns_the_stack_whole():
    """Adafactor without its block RMS steps each layer alone on the miniature, but at [130, 130, 4] it factors
    the layer dim, which one layer [1, 130, 4] would not: traced at both shapes, the stack is owned whole."""
    abstract = {
        "blocks": jax.ShapeDtypeStruct((130, 130, 4), jnp.float32),
        "w": jax.ShapeDtypeStruct((4, 5), jnp.float32),
    }
    inner = optax.adafactor(1e-2, clipping_threshold=None, multiply_by_parameter_scale=False)
    zero = build_zero(lambda p, b: 0.0, inner, pytree.mesh(2), abstract, jax.tree.map(lambda _: P(), abstract),
                      ZeroConfig("optim", "owned"), units={"blocks": 1, "w": None})  # fmt: skip
    assert zero.layout.owned.stacked == (False, False)
    one_layer = optax.adam(1e-2)  # steps every layer alone: owned by layer
    zero = build_zero(lambda p, b: 0.0, one_layer, pytree.mesh(2), abstract, jax.tree.map(lambda _: P(), abstract),
                      ZeroConfig("optim", "owned"), units={"blocks": 1, "w": None})  # fmt: skip
    assert zero.layout.owned.stacked == (True, False)


def test_refuses_a_chain_that_couples_experts():
    """A trust ratio over a whole expert param [E, m, n]: each ep rank would take it over its own experts."""
    abstract = {"experts": jax.ShapeDtypeStruct((4, 8, 6), jnp.float32), "w": jax.ShapeDtypeStruct((6, 5), jnp.float32)}
    specs = {"experts": P("ep", None, None), "w": P()}
    inner = optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale(-1e-2))
    with pytest.raises(ConfigError, match="differently alone than among all params"):
        build_zero(lambda p, b, ep_axis=None: 0.0, inner, pytree.mesh(2, ep=2), abstract, specs,
                   ZeroConfig("optim", "owned"), is_expert={"experts": True, "w": False})  # fmt: skip


@pytest.mark.slow
def test_muon_on_moe_matches_the_spec_layout():
    """Megatron's Muon (`optimizer.name: muon`, experts' matrices per expert) on jzero's MoE GPT, dp 2 x ep 2:
    the owned layout (expert pieces owned over the expert-DP domain, each ep rank its own experts) trains to the
    spec layout's numbers. Newton-Schulz in fp32: in bf16 the two layouts' GEMMs, summed in other orders,
    flip a bf16 rounding within a few steps (docs/megatron.md, "Muon")."""
    from helpers import rel_param_errors, run_steps

    runs = {}
    for path in ("spec", "owned"):
        cfg = tiny_config("optim", (2, 2, 1), 1, zero={"path": path}, model={"moe": MOE},
                          optimizer={"name": "muon", "warmup_steps": 0, "muon": {"ns_dtype": "float32"}})  # fmt: skip
        _, _, losses, norms, state = run_steps(cfg, devices=jax.devices()[:4])
        runs[path] = (losses, norms, jax.device_get(state.params))
    np.testing.assert_allclose(runs["owned"][0], runs["spec"][0], rtol=1e-5)
    np.testing.assert_allclose(runs["owned"][1], runs["spec"][1], rtol=1e-4)
    errors = rel_param_errors(runs["owned"][2], runs["spec"][2])
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: {errors[worst]:.2e}"
