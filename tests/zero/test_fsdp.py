"""ZeRO-3 (FSDP units) and HSDP on the spec path: fidelity against single-device optax, a user's
own model marking its units, what each stage shards, checkpoints between stages, refusals.
(The compiled program's collectives, inside the layer loop, are checked in test_fsdp_inspect.py.)"""

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import MOE, PATHS, assert_matches_reference, clip_by_global_norm, flat_config, tiny_config
from helpers.checkpoints import restore_matches, train_and_save
from jzero.cli import main
from jzero.config import ConfigError
from jzero.mesh import MeshConfig, make_mesh
from jzero.train.checkpoint import Checkpointer
from jzero.train.loop import setup
from jzero.zero import build_zero
from jzero.zero.common.units import unit
from jzero.zero.config import OuterStrategy, ShardingStrategy, ZeroConfig, ZeroPath

ZERO3 = "optim_grads_params"
SCAN = {"scan_layers": True, "remat": True}


def hsdp_config(strategy, mesh, microbatches=1, outer="no_shard", zero=None, **sections):
    """`tiny_config` on dp_outer=2 replicas of (dp, ep, tp) = `mesh`."""
    cfg = tiny_config(strategy, mesh, microbatches, zero={"outer_strategy": outer, **(zero or {})}, **sections)
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp_outer=2))


# ---------------------------------------------------------------- fidelity


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize(
    "mesh, model",
    [
        ((8, 1, 1), {}),  # one unit per block, unrolled
        ((4, 1, 2), {"scan_layers": True}),  # stacked units [L, ...], tp-local gathers
        ((2, 2, 2), {"moe": MOE}),  # expert params gathered over the expert-DP domain
    ],
    ids=["dp8", "dp4-tp2-scan", "dp2-ep2-tp2-moe"],
)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.matrix
def test_zero3_matches_single_device_optax(mesh, model, microbatches, path):
    # reshard_after_forward: false, and a model's own units: test_user_model_units_match_plain_optax
    assert_matches_reference(tiny_config(ZERO3, mesh, microbatches, model=model, zero={"path": path}))


@pytest.mark.parametrize(
    "strategy, mesh, microbatches, outer, path",
    [
        (ZERO3, (4, 1, 1), 2, "no_shard", "spec"),
        (ZERO3, (4, 1, 1), 1, "optim", "spec"),
        (ZERO3, (2, 1, 2), 2, "no_shard", "spec"),
        (ZERO3, (2, 1, 2), 1, "optim", "spec"),
        ("optim", (2, 1, 2), 1, "optim", "spec"),  # DDP / ZeRO-1: one sum over all DP, XLA's collectives
        ("optim_grads", (4, 1, 1), 2, "no_shard", "flat"),  # psum_scatter inner, psum across dp_outer
        ("optim_grads", (2, 2, 1), 1, "optim", "flat"),  # MoE: the expert buffer's inner domain is dp
        (ZERO3, (4, 1, 1), 2, "no_shard", "flat"),  # bucket shards gathered over the inner axes only
        (ZERO3, (2, 1, 2), 1, "optim", "flat"),  # the state split across dp_outer too
    ],
)
@pytest.mark.matrix
def test_hsdp_matches_single_device_optax(strategy, mesh, microbatches, outer, path):
    model = {"moe": MOE} if mesh[1] > 1 else {}
    assert_matches_reference(hsdp_config(strategy, mesh, microbatches, outer, zero={"path": path}, model=model))


# ---------------------------------------------------------------- a user's own model


def init_stack(layers=3, d=16):
    keys = jax.random.split(jax.random.key(0), layers + 1)
    stack = jnp.stack([jax.random.normal(k, (d, d)) / math.sqrt(d) for k in keys[1:]])
    return {"proj": jax.random.normal(keys[0], (8, d)) * 0.3, "layers": {"w": stack, "b": jnp.zeros((layers, d))}}


def stack_loss(params, batch):  # batch [B, 9]: 8 features + target
    """A residual tanh stack, scanned; each layer one FSDP unit through `unit`."""

    def layer(x, lp):
        return unit(lambda lp, x: x + jnp.tanh(x @ lp["w"] + lp["b"]), lp, x), None

    x, _ = jax.lax.scan(layer, batch[:, :8] @ params["proj"], params["layers"])
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


def trains_like_plain_optax(z, loss_fn, init, tx, steps, rows, clip=None) -> None:
    """`steps` steps of the `build_zero` run `z` (`init` its params, `tx` its chain) on random [rows, 9]
    batches: each loss, and then the params, are plain single-device optax's."""
    state = z.init_state(init)
    params, opt = init(), tx.init(init())
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = rng.standard_normal((rows, 9)).astype(np.float32)
        state, m = z.step(state, jax.device_put(batch, z.batch_sharding))
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        g = g if clip is None else clip_by_global_norm(g, clip)[0]
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(z.full_params(state.params)), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.slow
def test_user_model_units_match_plain_optax(reshard):
    """`units` marks the stacked layer params ([L, ...]: one unit per layer); the step gathers each
    layer's slice in the scan and reduce-scatters its grads there, and trains like plain optax."""
    mesh = make_mesh(MeshConfig(dp=8))
    abstract = jax.eval_shape(init_stack)
    tp_specs = jax.tree.map(lambda _: P(), abstract)
    units = {"proj": None, "layers": {"w": 1, "b": 1}}
    tx = optax.adamw(1e-2, weight_decay=0.1)
    zero = ZeroConfig(ShardingStrategy.OPTIM_GRADS_PARAMS, reshard_after_forward=reshard)
    z = build_zero(stack_loss, tx, mesh, abstract, tp_specs, zero, units=units, clip_grad=1.0, microbatches=2)
    assert z.plan.tensors["layers"]["w"].shard_dim != 0  # never the stacked-layer dim
    assert z.shardings.params["layers"]["w"].spec == P(None, ("dp_outer", "dp", "ep"), None)
    trains_like_plain_optax(z, stack_loss, init_stack, tx, steps=4, rows=32, clip=1.0)


def _layer(x, lp):  # at module level: jax caches the jaxprs it traces for it (a scan body)
    return unit(_tanh_block, lp, x, prevent_cse=False), None


def _tanh_block(lp, x):
    return x + jnp.tanh(x @ lp["w"] + lp["b"])


def module_level_loss(params, batch):
    x, _ = jax.lax.scan(_layer, batch[:, :8] @ params["proj"], params["layers"])
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.slow
def test_a_scan_body_jax_caches_trains_like_plain_optax(path):
    """`check_loss` traces the loss with the units' params as zeros just before the step's own trace;
    its probe is a static part of the units' hooks (`UnitHook.probe`), so jax's cache of the scan body's
    jaxpr cannot hand the probe's zeros to the step (it would, keyed on a probe flag kept elsewhere)."""
    mesh, abstract = make_mesh(MeshConfig(dp=8)), jax.eval_shape(init_stack)
    tx, tp_specs = optax.adam(1e-2), jax.tree.map(lambda _: P(), abstract)
    zero, units = ZeroConfig(ShardingStrategy.OPTIM_GRADS, ZeroPath(path)), {"proj": None, "layers": {"w": 1, "b": 1}}
    z = build_zero(module_level_loss, tx, mesh, abstract, tp_specs, zero, units=units)
    trains_like_plain_optax(z, module_level_loss, init_stack, tx, steps=2, rows=16)


def init_shared(d=16):
    keys = jax.random.split(jax.random.key(1), 2)
    return {"proj": jax.random.normal(keys[0], (8, d)) * 0.3,
            "block": {"w": jax.random.normal(keys[1], (d, d)) / math.sqrt(d), "b": jnp.full((d,), 0.01)}}  # fmt: skip


def shared_loss(params, batch):
    """One block run twice (its weights shared, as ALBERT's): two `unit` calls of one unit."""
    x = batch[:, :8] @ params["proj"]
    for _ in range(2):
        x = unit(lambda p, x: x + jnp.tanh(x @ p["w"] + p["b"]), params["block"], x)
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


def branch_loss(first: bool):
    """The block in both branches of a `cond` (traced twice, run once); `first`: which branch runs."""

    def loss(params, batch):
        block = lambda p, x: x + jnp.tanh(x @ p["w"] + p["b"])  # noqa: E731
        take = (jnp.sum(params["proj"]) < 1e9) if first else (jnp.sum(params["proj"]) > 1e9)
        x = batch[:, :8] @ params["proj"]
        x = jax.lax.cond(take, lambda x: unit(block, params["block"], x), lambda x: unit(block, params["block"], -x), x)
        return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)

    return loss


def _block(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])


def loop_loss(params, batch):
    """The shared block run twice by a loop whose body closes over its params (each iteration one call),
    recomputed in backward."""
    body = lambda i, x: unit(_block, params["block"], x, remat=True)  # noqa: E731
    x = jax.lax.fori_loop(0, 2, body, batch[:, :8] @ params["proj"])
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


def scan_closure_loss(params, batch):
    """As `loop_loss`, in a `scan` over nothing (ALBERT's layers, scanned)."""
    body = lambda x, _: (unit(_block, params["block"], x, prevent_cse=False), None)  # noqa: E731
    x, _ = jax.lax.scan(body, batch[:, :8] @ params["proj"], None, length=2)
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


@pytest.mark.parametrize(
    "path, loss, strategy",
    [("spec", shared_loss, "optim"), ("flat", shared_loss, "optim"), ("spec", branch_loss(True), "optim"),
     ("flat", branch_loss(False), "optim"), ("spec", loop_loss, "optim"), ("flat", scan_closure_loss, "optim"),
     ("spec", scan_closure_loss, "no_shard")],
    ids=["spec-shared", "flat-shared", "spec-cond-first-branch", "flat-cond-second-branch", "spec-loop",
         "flat-scan-closure", "spec-scan-closure-ddp"],
)  # fmt: skip
@pytest.mark.slow
def test_a_unit_run_twice_trains_like_plain_optax(path, loss, strategy):
    """Over 3 micro-batches ZeRO-1 adds the accumulated grads in its last micro-batch's backward and
    hands the params its first one gathered on (`overlap_param_gather`): once per unit, not once per
    call. Before, the block run twice took the accumulated grads twice and the params as 2 W. A unit in
    both branches of a `cond` adds them in each (one runs). A loop body that closes over the block's
    params runs it once per iteration: `unit_check.check_loss` finds that, and the step adds both once, after
    the backward (`units.micro_batch_loss`). Before, the loops' first step read a loss of 82.4 against
    64.2 (ZeRO-1), and DDP's update was off too."""
    mesh = make_mesh(MeshConfig(dp=8))
    abstract = jax.eval_shape(init_shared)
    tx = optax.adam(1e-2)
    zero, units = ZeroConfig(ShardingStrategy(strategy), ZeroPath(path)), {"proj": None, "block": {"w": 0, "b": 0}}
    tp_specs = jax.tree.map(lambda _: P(), abstract)
    z = build_zero(loss, tx, mesh, abstract, tp_specs, zero, units=units, microbatches=3)
    trains_like_plain_optax(z, loss, init_shared, tx, steps=3, rows=48)


def fori_stack_loss(take):
    """The stacked layers run by a `fori_loop` that closes over the stack and takes layer i's slice with
    `take(p, i)`."""

    def loss(params, batch):
        def layer(i, x):
            return unit(_block, jax.tree.map(lambda p: take(p, i), params["layers"]), x)

        x = jax.lax.fori_loop(0, 3, layer, batch[:, :8] @ params["proj"])  # init_stack's 3 layers
        return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)

    return loss


@pytest.mark.parametrize(
    "path, take",
    [("spec", lambda p, i: p[i]), ("flat", lambda p, i: jnp.take(p, i, axis=0))],
    ids=["spec-index", "flat-take"],
)
@pytest.mark.slow
def test_a_loop_slicing_the_stack_it_closes_over_trains_like_plain_optax(path, take):
    """A `fori_loop` body that closes over the stacked layers and slices layer i is a scan over them: each
    iteration's unit call gets its own layer's slice of the carry and of the gathered params, and keeps them
    (`jnp.take` slices inside a jit of its own: still a slice)."""
    mesh, abstract, loss = make_mesh(MeshConfig(dp=8)), jax.eval_shape(init_stack), fori_stack_loss(take)
    tx, tp_specs = optax.adam(1e-2), jax.tree.map(lambda _: P(), abstract)
    zero, units = ZeroConfig(ShardingStrategy.OPTIM, ZeroPath(path)), {"proj": None, "layers": {"w": 1, "b": 1}}
    z = build_zero(loss, tx, mesh, abstract, tp_specs, zero, units=units, microbatches=3)
    trains_like_plain_optax(z, loss, init_stack, tx, steps=2, rows=48)


def carry_loss(params, batch):
    """The shared block's params passed through a loop's carry."""
    step = lambda i, c: (c[0], unit(_block, c[0], c[1]))  # noqa: E731
    _, x = jax.lax.fori_loop(0, 2, step, (params["block"], batch[:, :8] @ params["proj"]))
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


def nested_loop_loss(params, batch):
    """A loop inside each scanned layer, closing over the layer's slice."""

    def layer(x, lp):
        return jax.lax.fori_loop(0, 2, lambda i, x: unit(_block, lp, x), x), None

    x, _ = jax.lax.scan(layer, batch[:, :8] @ params["proj"], params["layers"])
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


def skip_loss(params, batch):
    """LayerDrop: the block runs or not (a draw the same on every rank), its params a `cond`'s operand."""
    x, run = batch[:, :8] @ params["proj"], jnp.sum(params["proj"]) > 0
    x = jax.lax.cond(run, lambda p, x: unit(_block, p, x), lambda p, x: x, params["block"], x)
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


def twice_loss(params, batch):
    """The block called by the loss and again in a `jax.checkpoint` given its params as an argument."""
    x = unit(_block, params["block"], batch[:, :8] @ params["proj"])
    x = jax.checkpoint(lambda p, x: unit(_block, p, x))(params["block"], x)
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


def remat_in_scan_loss(params, batch):
    """Each scanned layer's unit in a `jax.checkpoint` that closes over the layer's slice."""

    def layer(x, lp):
        return jax.checkpoint(lambda x: unit(_block, lp, x))(x), None

    x, _ = jax.lax.scan(layer, batch[:, :8] @ params["proj"], params["layers"])
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


SHARED_UNITS, STACK_UNITS = {"proj": None, "block": {"w": 0, "b": 0}}, {"proj": None, "layers": {"w": 1, "b": 1}}


@pytest.mark.parametrize(
    "path, loss, init, units",
    [("spec", carry_loss, init_shared, SHARED_UNITS), ("flat", carry_loss, init_shared, SHARED_UNITS),
     ("spec", nested_loop_loss, init_stack, STACK_UNITS), ("flat", skip_loss, init_shared, SHARED_UNITS),
     ("spec", twice_loss, init_shared, SHARED_UNITS), ("flat", remat_in_scan_loss, init_stack, STACK_UNITS)],
    ids=["spec-carry", "flat-carry", "spec-nested", "flat-cond-skip", "spec-twice", "flat-remat-in-scan"],
)  # fmt: skip
@pytest.mark.slow
def test_a_unit_whose_first_call_is_not_once_trains_like_plain_optax(path, loss, init, units):
    """Over several micro-batches with overlap a unit's first call adds the earlier micro-batches' grads
    and hands the gathered params on. Where that call would not run exactly once per step (a loop body
    that runs it once per iteration on params in the carry, or on a scanned layer's slice it closes over;
    a `cond` with the unit in one branch, where a micro-batch that skips it would hand on zeros; a call in
    a transform given the params besides the loss's own) `unit_check.check_loss` finds it and the step adds
    them once, after the backward. Before, the carry and the second call trained silently wrong (the
    first step's loss read 82.4 against 64.2). A `jax.checkpoint` in a scanned layer runs once per layer:
    its call keeps them (the last case)."""
    abstract = jax.eval_shape(init)
    mesh, tp_specs, tx = make_mesh(MeshConfig(dp=8)), jax.tree.map(lambda _: P(), abstract), optax.adam(1e-2)
    z = build_zero(loss, tx, mesh, abstract, tp_specs, ZeroConfig(ShardingStrategy.OPTIM, ZeroPath(path)), units=units,
                   microbatches=3)  # fmt: skip
    trains_like_plain_optax(z, loss, init, tx, steps=2, rows=48)


@pytest.mark.parametrize("loss, warned", [(loop_loss, True), (carry_loss, True), (shared_loss, False)],
                         ids=["loop-closure", "carry", "twice"])  # fmt: skip
def test_a_unit_whose_first_call_is_not_once_is_named_in_a_warning(loss, warned):
    """Where the step adds a unit's carry and gathered params after the backward (`unit_check.check_loss`), it
    says so once it traces, naming the params: that unit pays one more reduction and gather per step,
    which `jzero hlo`'s theory does not count. A block run twice by the loss keeps them in its first
    call: no warning."""
    abstract = jax.eval_shape(init_shared)
    mesh, tp_specs, tx = make_mesh(MeshConfig(dp=8)), jax.tree.map(lambda _: P(), abstract), optax.adam(1e-2)
    z = build_zero(loss, tx, mesh, abstract, tp_specs, ZeroConfig(ShardingStrategy.OPTIM), units=SHARED_UNITS,
                   microbatches=3)  # fmt: skip
    batch = jax.ShapeDtypeStruct((48, 9), jnp.float32, sharding=z.batch_sharding)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        z.step.lower(z.init_state(init_shared), batch)
    said = [str(w.message) for w in caught if "jzero.zero.unit" in str(w.message)]
    assert [("2 unit param(s) (block/b, block/w)" in m) for m in said] == ([True] * len(said) if warned else [])
    assert bool(said) == warned


@pytest.mark.slow
def test_zero3_runs_a_unit_on_params_a_loop_carries():
    """ZeRO-3 adds no carry and hands nothing on: a unit on params in a loop's carry trains like plain optax."""
    mesh, abstract = make_mesh(MeshConfig(dp=8)), jax.eval_shape(init_shared)
    tx, tp_specs, units = optax.adam(1e-2), jax.tree.map(lambda _: P(), abstract), SHARED_UNITS
    zero = ZeroConfig(ShardingStrategy.OPTIM_GRADS_PARAMS)
    z = build_zero(carry_loss, tx, mesh, abstract, tp_specs, zero, units=units, microbatches=2)
    trains_like_plain_optax(z, carry_loss, init_shared, tx, steps=2, rows=32)


@pytest.mark.parametrize("path", PATHS)
def test_a_loss_reading_unit_params_outside_unit_is_refused(path):
    """An L2 penalty over all params in the loss would read the unit params as a `UnitParam` holds them
    (this rank's shard, the zero sinks) and miss their grads: refused at trace time, naming the param.
    Before, it trained silently wrong (the spec path) or failed inside shard_map (the flat path)."""

    def penalized(params, batch):
        return stack_loss(params, batch) + 1e-2 * sum(jnp.sum(p * p) for p in jax.tree.leaves(params))

    abstract = jax.eval_shape(init_stack)
    mesh, tp_specs = make_mesh(MeshConfig(dp=8)), jax.tree.map(lambda _: P(), abstract)
    zero, units = ZeroConfig(ShardingStrategy.OPTIM_GRADS, ZeroPath(path)), {"proj": None, "layers": {"w": 1, "b": 1}}
    z = build_zero(penalized, optax.adam(1e-2), mesh, abstract, tp_specs, zero, units=units)
    batch = jax.device_put(np.ones((16, 9), np.float32), z.batch_sharding)
    with pytest.raises(ValueError, match="the loss reads unit param 'layers/b' outside `unit`"):
        z.step(z.init_state(init_stack), batch)


def init_named(d=16):
    keys = jax.random.split(jax.random.key(2), 3)
    blocks = {n: {"w": jax.random.normal(k, (d, d)) / math.sqrt(d), "b": jnp.zeros((d,))} for n, k in zip("ab", keys)}
    return {"proj": jax.random.normal(keys[2], (8, d)) * 0.3, "enc": blocks}


def named_loss(params, batch):
    """Blocks under string keys, each its own unit call: no integer key names them apart."""
    x = batch[:, :8] @ params["proj"]
    for n in "ab":
        x = unit(lambda p, x: x + jnp.tanh(x @ p["w"] + p["b"]), params["enc"][n], x)
    return jnp.mean((x.sum(-1) - batch[:, 8]) ** 2)


@pytest.mark.slow
def test_unit_key_names_the_flat_paths_units():
    """The flat path lays out buffers per unit, named from the param's path (`flat/plan.unit_key`: up to
    its first integer key, else its first key: `enc` for both blocks here). A unit call that gets part of
    such a unit is refused, naming `unit_key`; with `unit_key` naming each block the step trains like
    plain optax."""
    mesh, abstract = make_mesh(MeshConfig(dp=8)), jax.eval_shape(init_named)
    tx, tp_specs = optax.adam(1e-2), jax.tree.map(lambda _: P(), abstract)
    zero = ZeroConfig(ShardingStrategy.OPTIM_GRADS, ZeroPath.FLAT)
    units = {"proj": None, "enc": {n: {"w": 0, "b": 0} for n in "ab"}}
    z = build_zero(named_loss, tx, mesh, abstract, tp_specs, zero, units=units)
    with pytest.raises(ValueError, match="got part of the params of unit 'enc'.*unit_key"):
        z.step(z.init_state(init_named), jax.device_put(np.ones((16, 9), np.float32), z.batch_sharding))
    with pytest.raises(ConfigError, match="unit_key named no unit .* for unit param enc.a.b"):
        build_zero(named_loss, tx, mesh, abstract, tp_specs, zero, units=units, unit_key=lambda path: "")
    key = lambda path: jax.tree_util.keystr(path[:2])  # noqa: E731
    z = build_zero(named_loss, tx, mesh, abstract, tp_specs, zero, units=units, unit_key=key)
    assert [g.key for g in z.flat.groups] == ["['enc']['a']", "['enc']['b']", ""]  # "": the params in no unit
    trains_like_plain_optax(z, named_loss, init_named, tx, steps=2, rows=16)


def test_unit_outside_a_zero_step_is_a_plain_call():
    params = init_stack()
    batch = jnp.ones((4, 9))
    assert float(stack_loss(params, batch)) == pytest.approx(float(stack_loss(params, batch)))
    assert unit(lambda p, x: p * x, 2.0, 3.0) == 6.0


# ---------------------------------------------------------------- what is sharded


def _bytes_per_device(shardings, tensors) -> int:
    return sum(
        math.prod(s.shard_shape(t.shape)) * t.dtype.itemsize
        for s, t in zip(jax.tree.leaves(shardings), jax.tree.leaves(tensors))
    )


@pytest.mark.parametrize(
    "cfg, d_params, d_state",
    [
        (tiny_config(ZERO3, (8, 1, 1)), 8, 8),
        (tiny_config(ZERO3, (4, 1, 2)), 4, 4),
        (hsdp_config(ZERO3, (4, 1, 1), outer="no_shard"), 4, 4),  # replicated across dp_outer
        (hsdp_config(ZERO3, (4, 1, 1), outer="optim"), 4, 8),  # state split across dp_outer too
        # ZeRO-2 with overlap_param_gather (it follows overlap_grad_reduce): the params rest split over dp
        (hsdp_config("optim_grads", (4, 1, 1), outer="optim"), 4, 8),
        (hsdp_config("optim_grads", (4, 1, 1), outer="optim", zero={"overlap_grad_reduce": False}), 1, 8),
    ],
    ids=["zero3-dp8", "zero3-dp4-tp2", "hsdp-no_shard", "hsdp-optim", "hsdp-zero2-optim", "hsdp-zero2-optim-whole"],
)
def test_per_device_bytes_are_ddps_over_the_sharding_degree(cfg, d_params, d_state):
    """Model params and fp32 state per device, from the run's shardings, are DDP's divided by the
    degree each is split over (every tensor of the tiny GPT has a dim that divides 8)."""
    ddp = setup(dataclasses.replace(cfg, zero=ZeroConfig(ShardingStrategy.NO_SHARD), mesh=MeshConfig(
        dp=cfg.mesh.dp * cfg.mesh.dp_outer, tp=cfg.mesh.tp)), with_data=False).zero  # fmt: skip
    z = setup(cfg, with_data=False).zero
    assert not z.plan.replicated()
    tensors = z.plan.tensors
    params = _bytes_per_device(z.shardings.params, tensors)
    assert params * d_params == _bytes_per_device(ddp.shardings.params, tensors)
    state = _bytes_per_device(z.plan.state_shardings(), tensors)
    assert state * d_state == _bytes_per_device(ddp.plan.state_shardings(), tensors)


# ---------------------------------------------------------------- checkpoints between stages


@pytest.mark.slow
def test_checkpoints_move_between_zero3_hsdp_and_the_other_stages(tmp_path):
    """A ZeRO-3 (4, 1, 2) checkpoint restores onto HSDP ZeRO-3 optim (2 x 2 x tp 2), which trains on.
    Checkpoints are in model space, so any stage restores onto any other (the flat path's side of
    that: test_checkpoint.py, test_moe.py)."""
    bf16 = {"precision": {"param_dtype": "bfloat16"}, "model": {"scan_layers": True}}  # fp32 main params too
    whole = train_and_save(tmp_path / "a", tiny_config(ZERO3, (4, 1, 2), **bf16))
    assert "main_params" in whole
    restore_matches(tmp_path / "a", whole, hsdp_config(ZERO3, (2, 1, 2), outer="optim", **bf16), train=True)


@pytest.mark.slow
def test_checkpoints_move_between_flat_units_the_spec_path_and_flat_without_overlap(tmp_path):
    """Model space both ways: a flat per-unit ZeRO-3 checkpoint (bucket-shard params, stacked buckets)
    restores onto the spec path's ZeRO-2 and onto the flat path's ZeRO-1 without overlap (one layout),
    and theirs onto flat ZeRO-3, every shard the saved slice."""
    bf16 = {"precision": {"param_dtype": "bfloat16"}}
    flat3 = flat_config(ZERO3, (4, 1, 2), model=SCAN, precision=bf16["precision"])
    flat3_run = setup(flat3)  # each run built once: trained and saved, restored onto
    whole = train_and_save(tmp_path / "a", flat3, run=flat3_run)
    assert "main_params" in whole
    restore_matches(tmp_path / "a", whole, tiny_config("optim_grads", (8, 1, 1), model=SCAN, **bf16))
    off = tiny_config("optim", (4, 1, 2), model=SCAN, zero={"path": "flat", "overlap_grad_reduce": False}, **bf16)
    off_run = setup(off)
    restore_matches(tmp_path / "a", whole, off, run=off_run)
    whole = train_and_save(tmp_path / "b", off, run=off_run)
    restore_matches(tmp_path / "b", whole, flat3, train=True, run=flat3_run)


@pytest.mark.slow
def test_flat_zero3_resumes_bitwise(tmp_path):
    """Two steps, a checkpoint, one more step: the same state as three steps straight."""
    cfg = flat_config(ZERO3, (4, 1, 2), model=SCAN)
    run = setup(cfg)
    state = run.init_state()
    for i in range(2):
        state, _ = run.zero.step(state, run.device_batch(i))
    ck = Checkpointer(tmp_path / "ck", run, async_save=False)
    ck.save(state, cfg)
    ck.close()
    straight, _ = run.zero.step(state, run.device_batch(2))
    reader = Checkpointer(tmp_path / "ck", run, writer=False)
    resumed, _ = run.zero.step(reader.restore(2), run.device_batch(2))
    reader.close()
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- refusals


def test_the_flat_paths_zero3_refuses_only_a_quantized_gather():
    """Flat ZeRO-3 builds (its params rest as bucket shards, gathered per unit in the forward); the
    quantized gather after the optimizer step (`zero.param_gather_dtype`) has no place there."""
    z = setup(tiny_config(ZERO3, (8, 1, 1), zero={"path": "flat"}), with_data=False).zero
    assert z.flat.plan.stage.params_rest_sharded and not z.params_in_state
    with pytest.raises(ConfigError, match="params are gathered in the forward"):
        ZeroConfig(ShardingStrategy.OPTIM_GRADS_PARAMS, ZeroPath.FLAT, param_gather_dtype="int8")


@pytest.mark.parametrize(
    "sets, message",
    [
        (["zero.strategy=optim_grads_params", "zero.path=flat", "zero.param_gather_dtype=int8"], "in the forward"),
        (["zero.outer_strategy=everything"], "zero.outer_strategy"),
        (["mesh.dp_outer=3"], "mesh"),
    ],
)
def test_cli_refuses_with_one_line(sets, message, capsys, tmp_path):
    args = [a for s in sets for a in ("--set", s)]
    assert main(["train", "--out", str(tmp_path), "--set", "train.steps=1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_outer_strategy_parses():
    assert ZeroConfig(outer_strategy=OuterStrategy("optim")).outer_strategy == OuterStrategy.OPTIM
