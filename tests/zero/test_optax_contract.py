"""The library contract: jzero wraps any optax transformation (spec path) and every element-wise
one plus param groups (flat path), on a user's own params and loss, training to the numbers of
plain single-device optax; the flat path refuses the rest with one clear error.

The problem is optax's own test problems (the parabola and Rosenbrock of optax's alias tests)
beside a tree of odd-shaped leaves: ranks 0 to 3, sizes that 8 ranks do and do not divide, an
empty leaf (where jaxlib's XLA compiles one), and one large enough for adafactor to factor.
"""

import functools

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import clip_by_global_norm
from jzero.config import ConfigError
from jzero.mesh import MeshConfig, make_mesh
from jzero.zero import ParamGroup, build_zero, groups
from jzero.zero.build import xla_crashes_on_empty_params
from jzero.zero.config import ShardingStrategy, ZeroConfig, ZeroPath

STEPS = 10
SHAPES = {"vec3": (3,), "mat": (16, 5), "cube": (8, 3, 7), "wide": (128, 136), "odd": (129, 130), "empty": (0, 4),
          "scalar": ()}  # fmt: skip
if xla_crashes_on_empty_params(jaxlib.__version__):  # build_zero refuses the 0-size leaf (tests/zero/test_build.py)
    del SHAPES["empty"]
RNG = np.random.default_rng(0)
TARGETS = {k: jnp.asarray(RNG.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
FINAL = jnp.array([1.0, -1.0, 1.0])


def init_params():
    params = {k: jnp.asarray(RNG.standard_normal(s) * 0.5, jnp.float32) for k, s in SHAPES.items()}
    return {"parabola": jnp.array([-1.0, 10.0, 1.0]), "rosenbrock": jnp.array([0.0, 0.0]), "odd": params}


PARAMS = init_params()


def loss_fn(params, batch):  # batch [B, 1]: one scale per example
    x = batch[:, 0]
    parabola = jnp.sum(jnp.square(params["parabola"] - FINAL))
    r = params["rosenbrock"]
    rosenbrock = jnp.square(1.0 - r[0]) + 100.0 * jnp.square(r[1] - r[0] ** 2)
    odd = sum(  # per element (p - x t)^2, averaged over the batch: O(1) grads on every leaf
        jnp.sum(jnp.mean(jnp.square(p[None] - x.reshape(-1, *[1] * p.ndim) * TARGETS[k]), axis=0))
        for k, p in params["odd"].items()
    )
    return jnp.mean(x) * (parabola + 1e-2 * rosenbrock) + odd


def batches():
    rng = np.random.default_rng(1)
    return [rng.uniform(0.5, 1.5, (16, 1)).astype(np.float32) for _ in range(STEPS)]


def decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _label(params):
    return jax.tree.map(lambda p: "adam" if p.ndim >= 2 else "sgd", params)


ELEMENTWISE = {
    "sgd": lambda: optax.sgd(1e-2),
    "momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "adagrad": lambda: optax.adagrad(1e-1),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}
PER_TENSOR = {
    "lamb": lambda: optax.lamb(1e-2),
    "masked_weight_decay": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask),
    "clip_inside_chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "adafactor": lambda: optax.adafactor(1e-2),
    "multi_transform": lambda: optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2)}, _label),
    "masked_pair": lambda: optax.chain(
        optax.masked(optax.adam(1e-2), decay_mask), optax.masked(optax.sgd(1e-2), lambda p: jax.tree.map(
            lambda m: not m, decay_mask(p)))
    ),
}


TABLE = {**ELEMENTWISE, **PER_TENSOR}


@functools.cache
def reference(name: str, clip: float | None = None):
    """Plain single-device optax: the params after STEPS steps of TABLE[name]."""
    return plain_optax_run(TABLE[name](), clip)


def plain_optax_run(tx, clip=None):

    @jax.jit
    def step(params, state, batch):
        g, _ = clip_by_global_norm(jax.grad(loss_fn)(params, batch), clip)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    params, state = PARAMS, tx.init(PARAMS)
    for batch in batches():
        params, state = step(params, state, jnp.asarray(batch))
    return params


def run_jzero(tx, strategy, path, clip=None, groups_=None, mesh=(4, 2)):
    mesh = make_mesh(MeshConfig(dp=mesh[0], ep=mesh[1]))
    abstract = jax.eval_shape(lambda: PARAMS)
    tp_specs = jax.tree.map(lambda _: P(), abstract)
    z = build_zero(loss_fn, tx, mesh, abstract, tp_specs, ZeroConfig(strategy=strategy, path=path), clip_grad=clip,
                   groups=groups_)  # fmt: skip
    state = z.init_state(lambda: PARAMS)
    for batch in batches():
        state, _ = z.step(state, jax.device_put(batch, z.batch_sharding))
    return z, state


def assert_close(params, ref):
    """Every leaf within 1e-6 relative of the reference, which moved every leaf visibly."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, a), b, b0 in zip(leaves, jax.tree.leaves(ref), jax.tree.leaves(PARAMS)):
        if b.size:
            a, b, b0 = (np.asarray(x, np.float64) for x in (a, b, b0))
            assert np.linalg.norm(b - b0) > 1e-3 * np.linalg.norm(b0), f"{jax.tree_util.keystr(path)} barely moved"
            err = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert err < 1e-6, f"{jax.tree_util.keystr(path)}: {err:.2e}"


# With one microbatch (run_jzero's), ZeRO-1 reduces the grads after the last microbatch and ZeRO-2 at
# each one, into the same sharded state: one program on each path (the spec path's ZeRO-2 cases
# compiled to ZeRO-1's executables, served from the compilation cache), run once.
STRATEGIES = [ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM]
FLAT_STRATEGIES = [ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM_GRADS]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.value)
@pytest.mark.parametrize("name", [*ELEMENTWISE, *PER_TENSOR])
@pytest.mark.matrix
def test_spec_path_runs_any_optax_transformation(name, strategy):
    clip = 1.0 if name == "adam" else None  # jzero's own clipping across shards, on one of them
    _, state = run_jzero(TABLE[name](), strategy, ZeroPath.SPEC, clip)
    assert_close(state.params, reference(name, clip))


@pytest.mark.parametrize("strategy", FLAT_STRATEGIES, ids=lambda s: s.value)
@pytest.mark.parametrize("name", list(ELEMENTWISE))
@pytest.mark.matrix
def test_flat_path_runs_elementwise_transformations(name, strategy):
    z, state = run_jzero(TABLE[name](), strategy, ZeroPath.FLAT)
    assert_close(z.full_params(state.params), reference(name))


@pytest.mark.parametrize("name", list(PER_TENSOR))
def test_flat_path_refuses_the_rest_naming_it(name):
    with pytest.raises(ConfigError) as e:
        run_jzero(TABLE[name](), ShardingStrategy.OPTIM_GRADS, ZeroPath.FLAT)
    msg = str(e.value)
    assert "zero.path=flat" in msg and "zero.path=spec" in msg and "jzero.zero.groups" in msg
    assert len(msg.splitlines()) == 1
    named = {"lamb": "scale_by_trust_ratio", "masked_weight_decay": "masked(add_decayed_weights)",
             "clip_inside_chain": "clip_by_global_norm", "adafactor": "scale_by_factored_rms",
             "multi_transform": "partition(", "masked_pair": "masked("}  # fmt: skip
    assert named[name] in msg


HIDDEN = {  # not element-wise, and the old probe's two steps could not tell: they trained wrong on flat and owned
    # the masked decay acts every 4th step only (before, each step's update was zero: 0 x the inner's)
    "multi_steps_masked": lambda: optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.5, mask=decay_mask), 4),
    "apply_every_masked": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.5), decay_mask), optax.sgd(1e-2), optax.apply_every(3)
    ),
    # its learning-rate estimate, a statistic over every param kept in the state, acts from the third step on
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
}


@pytest.mark.parametrize(
    "name", [n if n == "multi_steps_masked" else pytest.param(n, marks=pytest.mark.slow) for n in HIDDEN]
)
def test_chains_whose_difference_shows_after_two_steps_are_refused(name):
    """The probe runs a MultiSteps or apply_every chain for 64 steps, and compares the state's scalars
    (the owned path's: tests/zero/owned/test_layout.py)."""
    with pytest.raises(ConfigError) as e:
        run_jzero(HIDDEN[name](), ShardingStrategy.OPTIM, ZeroPath.FLAT)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "zero.path=flat" in msg and "zero.path=spec" in msg
    if name == "multi_steps_masked":
        assert "MultiSteps is not: on flat buffer shards its update differs" in msg
    if name == "dadapt_adamw":
        assert "a scalar of" in msg and "state differs" in msg


def test_a_clip_inside_the_chain_is_refused_at_a_learning_rate_warming_up_from_zero():
    """The probe steps the chain at its schedule's first steps, whose updates a warmup from 0 keeps tiny (3e-4
    over 2000 steps: 1e-7 of the params): a difference in them counts relative to the update, not to the params
    (an allowance of the params' rounding accepted this chain, which would train wrong on flat buffer shards)."""
    lr = optax.linear_schedule(0.0, 3e-4, 2000)
    tx = optax.chain(optax.zero_nans(), optax.clip_by_global_norm(1.0), optax.adamw(lr))
    with pytest.raises(ConfigError, match="clip_by_global_norm"):
        run_jzero(tx, ShardingStrategy.OPTIM_GRADS, ZeroPath.FLAT)


def test_a_multi_steps_chain_that_emits_nothing_in_the_probe_is_refused():
    with pytest.raises(ConfigError, match=r"^zero.path=flat cannot check MultiSteps: it updated no param in 64 steps"):
        run_jzero(optax.MultiSteps(optax.adam(1e-2), 100), ShardingStrategy.OPTIM, ZeroPath.FLAT)


def test_factored_state_gets_shardings_of_its_own():
    """adafactor's v_row [128] and v_col [136] of the [128, 136] leaf: sharded over DP where 8 divides."""
    z, state = run_jzero(optax.adafactor(1e-2), ShardingStrategy.OPTIM, ZeroPath.SPEC, mesh=(8, 1))
    factored = state.opt_state.inner_state[0]
    dp = ("dp_outer", "dp", "ep")
    assert factored.v_row["odd"]["wide"].sharding.spec == P(dp)
    assert factored.v_col["odd"]["wide"].sharding.spec == P(dp)
    assert factored.v_row["odd"]["odd"].sharding.spec == P()  # 129 and 130: no dim divides 8
    assert factored.v["odd"]["wide"].shape == (1,)  # factored: v is a placeholder
    assert jax.tree.leaves(z.shardings.opt_state) == [x.sharding for x in jax.tree.leaves(state.opt_state)]


GROUPS = jax.tree.map(lambda _: ParamGroup(), jax.eval_shape(lambda: PARAMS))
GROUPS = {**GROUPS, "rosenbrock": ParamGroup(lr_mult=0.5), "odd": {
    **GROUPS["odd"], "mat": ParamGroup(wd_mult=0.0), "cube": ParamGroup(lr_mult=2.0, wd_mult=0.5),
    "vec3": ParamGroup(wd_mult=0.0)}}  # fmt: skip


@functools.cache
def groups_reference(every_k: int = 1):
    """The groups above in plain optax: one optax.adamw per group (lr x lr_mult, wd x wd_mult); inside
    `optax.MultiSteps(..., every_k)` where every_k > 1."""
    is_group = lambda g: isinstance(g, ParamGroup)  # noqa: E731
    distinct = sorted(set(jax.tree.leaves(GROUPS, is_leaf=is_group)))
    labels = jax.tree.map(lambda g: str(distinct.index(g)), GROUPS, is_leaf=is_group)
    lr = optax.linear_schedule(1e-2, 1e-3, STEPS)

    def make(g):
        rate = lr if g.lr_mult == 1 else (lambda c: lr(c) * g.lr_mult)
        return optax.adamw(rate, weight_decay=0.1 * g.wd_mult)

    tx = optax.multi_transform({str(i): make(g) for i, g in enumerate(distinct)}, labels)
    return plain_optax_run(tx if every_k == 1 else optax.MultiSteps(tx, every_k))


@pytest.mark.parametrize(
    "strategy, path",
    [(s, ZeroPath.SPEC) for s in STRATEGIES] + [(s, ZeroPath.FLAT) for s in FLAT_STRATEGIES],
    ids=lambda x: x.value,
)
@pytest.mark.matrix
def test_param_groups_train_like_plain_optax_on_both_paths(strategy, path):
    """Megatron's param groups (no decay on some params, lr and wd multipliers) as jzero groups."""
    tx = groups.adamw(optax.linear_schedule(1e-2, 1e-3, STEPS), weight_decay=0.1)
    z, state = run_jzero(tx, strategy, path, groups_=GROUPS)
    assert_close(z.full_params(state.params), groups_reference())


@pytest.mark.parametrize("path", [ZeroPath.SPEC, ZeroPath.FLAT])
def test_param_groups_reach_the_chain_inside_multi_steps(path):
    """`optax.MultiSteps` forwards extra arguments to the chain it wraps but is no
    GradientTransformationExtraArgs: optax's wrapper dropped `param_groups`, and the build refused it (advising
    the groups.add_decayed_weights the chain already held)."""
    tx = optax.MultiSteps(groups.adamw(optax.linear_schedule(1e-2, 1e-3, STEPS), weight_decay=0.1), 2)
    z, state = run_jzero(tx, ShardingStrategy.OPTIM, path, groups_=GROUPS)
    assert_close(z.full_params(state.params), groups_reference(every_k=2))


def test_param_groups_an_optimizer_ignores_are_refused():
    with pytest.raises(ConfigError, match="never reads it"):
        run_jzero(optax.adamw(1e-2), ShardingStrategy.OPTIM_GRADS, ZeroPath.SPEC, groups_=GROUPS)
    only_lr = jax.tree.map(lambda g: ParamGroup(lr_mult=g.lr_mult), GROUPS, is_leaf=lambda g: isinstance(g, ParamGroup))
    with pytest.raises(ConfigError, match="wd_mult"):  # reads lr_mult, not wd_mult
        tx = optax.chain(optax.adamw(1e-2), groups.scale_by_lr_mult())
        run_jzero(tx, ShardingStrategy.OPTIM_GRADS, ZeroPath.SPEC, groups_=GROUPS)
    run_jzero(optax.chain(optax.adam(1e-2), groups.scale_by_lr_mult()), ShardingStrategy.OPTIM, ZeroPath.SPEC,
              groups_=only_lr)  # fmt: skip


def test_groups_adamw_is_optax_adamw_without_groups():
    g = jax.jit(jax.grad(loss_fn))(PARAMS, jnp.asarray(batches()[0]))

    @jax.jit
    def updates(g):
        tx, ref = groups.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
        return tx.update(g, tx.init(PARAMS), PARAMS)[0], ref.update(g, ref.init(PARAMS), PARAMS)[0]

    u, u_ref = updates(g)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_ref)):
        np.testing.assert_array_equal(a, b)
