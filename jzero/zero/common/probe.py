"""Build-time checks of the inner optax transformation, run on a miniature of the params.

- `check_elementwise` (flat path): the flat path steps the inner transformation on each
  rank's slices of flat buckets. Only element-wise transformations (Adam, SGD, Lion, ...,
  with jzero's param groups) mean the same there; per-tensor ones (LAMB/LARS trust ratios,
  adafactor's factored moments, masks, labels) and norms taken inside the chain would
  train silently wrong (docs/xla.md, "Which optax transformations survive a flat buffer").
- `check_groups_read` (both paths): param groups only act through the transformations
  that read them (`groups.add_decayed_weights`, `groups.scale_by_lr_mult`); groups that
  the inner transformation never reads are refused rather than silently ignored.

The miniature keeps every param's rank, and its shape up to `MINIATURE_ELEMENTS` (a larger param's
largest dims are halved until it fits), so a chain that decides by a param's rank (a mask on
`p.ndim`) decides on the miniature as on the params; one that decides by size beyond that is caught
by comparing its update program on the two shapes (`_decides_by_size`). Its grads probe what a chain may
do across elements: the first two steps' are N(0, 1) (SM3's second step takes a row's and a column's
statistics of the first), the third's are scaled by `LARGE_GRADS` (any clip threshold below is crossed;
run first, its moments would dwarf every later step's difference), the fourth carries one NaN (a skip of
non-finite updates acts on the whole tree). Besides the updates, the scalars of the state the steps leave
must agree: a statistic over the whole tree kept in the state (D-Adaptation's learning-rate estimate, used
from the third step on) differs on a slice. A chain
holding `optax.MultiSteps` or `optax.apply_every` emits an update only every k-th step and zeros in between,
so its probe runs `MULTI_STEPS_PROBE` steps (a scan), and one that emits none in them is refused.
"""

from __future__ import annotations

import collections
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jzero.errors import ConfigError
from jzero.mesh import entry_axes
from jzero.zero.common.groups import GroupValues, ParamGroup, group_leaves, per_param_values
from jzero.zero.common.strategies import ShardingPlan, path_name
from jzero.zero.common.update import inner_update

PyTree = Any
TOLERANCE = 1e-6  # relative; element-wise transformations agree to rounding (adamw: 1e-9)
MINIATURE_ELEMENTS = 64
LARGE_GRADS = 1e8
PROBE_STEPS = 4
LARGE_STEP, NAN_STEP = 2, 3  # of the probe's steps (module docstring)
MULTI_STEPS_PROBE = 64  # a chain with optax.MultiSteps: k <= 32 shows two emitted updates
# check_per_tensor: a param stepped alone is a different XLA program (Newton-Schulz's matmuls fuse and sum
# in another order: 1e-6 relative, measured on Muon); a chain coupling params differs by O(1) there (the
# probe's third step's grads are LARGE_GRADS: any clip crosses its threshold).
PER_TENSOR_TOLERANCE = 1e-4


def transformation_name(tx: optax.GradientTransformation) -> str:
    """`chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, scale)`: the optax functions
    that built `tx`, read from its update function's closure (best effort, for error messages)."""

    def name(fn, depth: int) -> str:
        top = getattr(fn, "__qualname__", type(fn).__name__).split(".")[0]
        parts = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, dict):
                items = value.values()
            else:
                items = value if isinstance(value, (tuple, list)) else [value]
            for item in items:
                update = item if inspect.isfunction(item) else getattr(item, "update", None)
                if depth and inspect.isfunction(update) and "update" in update.__qualname__:
                    parts.append(name(update, depth - 1))
        if top == "with_extra_args_support" and len(parts) == 1:
            return parts[0]  # optax's wrapper for plain transformations: transparent
        return f"{top}({', '.join(parts)})" if parts else top

    return name(tx.update, 6)


def _miniature_shape(shape: tuple[int, ...]) -> list[int]:
    """`shape`, its largest dim halved (rounding up) until it holds at most MINIATURE_ELEMENTS."""
    dims = list(shape)
    while math.prod(dims) > MINIATURE_ELEMENTS:
        i = dims.index(max(dims))
        dims[i] = (dims[i] + 1) // 2
    return dims


def _miniature(plan: ShardingPlan, steps: int = PROBE_STEPS, seed: int = 0) -> tuple[PyTree, list[PyTree]]:
    """(params, `steps` steps of grads): random fp32 arrays of each param's miniature shape; step LARGE_STEP's
    grads times LARGE_GRADS, step NAN_STEP's with a NaN in the first element of the largest param."""
    rng = np.random.default_rng(seed)

    def draw(t):
        return rng.standard_normal(_miniature_shape(t.shape)).astype(np.float32)

    params = jax.tree.map(draw, plan.tensors)
    grads = [jax.tree.map(draw, plan.tensors) for _ in range(steps)]
    grads[LARGE_STEP] = jax.tree.map(lambda g: g * LARGE_GRADS, grads[LARGE_STEP])
    largest = max(jax.tree.leaves(grads[NAN_STEP]), key=np.size, default=None)
    if largest is not None and largest.size:
        largest.reshape(-1)[0] = np.nan
    as_arrays = lambda tree: jax.tree.map(jnp.asarray, tree)  # noqa: E731
    return as_arrays(params), [as_arrays(g) for g in grads]


def _decides_by_size(inner, plan: ShardingPlan, values) -> bool:
    """Whether `inner` builds another update program (its primitives, counted) for the params' shapes than
    for their miniature's: a chain that decides by a param's size beyond MINIATURE_ELEMENTS (a mask on
    `p.size >= 10**6`), which the miniature cannot show and a bucket shard would decide otherwise.
    Traced only, on abstract arrays: nothing of the params' size is made."""

    def program(shape_of: Callable[[tuple[int, ...]], Any]) -> collections.Counter:
        specs = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(shape_of(t.shape)), jnp.float32), plan.tensors)
        return _primitives(jax.make_jaxpr(lambda p, g: _run(inner, p, [g], values))(specs, specs).jaxpr)

    return program(tuple) != program(_miniature_shape)


def _primitives(jaxpr: Jaxpr, detail: bool = False) -> collections.Counter:
    """How often each primitive runs in `jaxpr`, the jaxprs it calls counted at each call (jax shares
    one sub-jaxpr between calls of equal shapes, which the miniature's shapes make more of); with
    `detail`, each with the dims it names (`axes`, `dimensions`, `permutation`)."""
    count = collections.Counter()
    for eqn in jaxpr.eqns:
        dims = tuple(str(eqn.params.get(k)) for k in ("axes", "dimensions", "permutation")) if detail else ()
        count[(eqn.primitive.name, *dims) if detail else eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    count += _primitives(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub, detail)
    return count


def _step_error(a: jax.Array, b: jax.Array) -> float:
    """The largest over steps ([steps, ...]) of |a - b| / |b|, a NaN or inf in one where the other has
    none counting as infinite."""
    a, b = np.asarray(a, np.float64).reshape(len(a), -1), np.asarray(b, np.float64).reshape(len(b), -1)
    worst = 0.0
    for x, y in zip(a, b):
        odd = ~np.isfinite(y)
        if not np.array_equal(odd, ~np.isfinite(x)) or not np.array_equal(x[odd], y[odd], equal_nan=True):
            return math.inf
        x, y = x[~odd], y[~odd]
        worst = max(worst, float(np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-30)))
    return worst


def _multi_steps(inner, plan: ShardingPlan) -> bool:
    """Whether `inner`'s state holds an `optax.MultiStepsState` or `optax.ApplyEvery` (module docstring)."""
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(t.shape), jnp.float32), plan.tensors)
    is_multi = lambda x: isinstance(x, (optax.MultiStepsState, optax.ApplyEvery))  # noqa: E731
    return any(is_multi(x) for x in jax.tree.leaves(jax.eval_shape(inner.init, abstract), is_leaf=is_multi))


def _check_emits(what: str, path: str, reference: list[jax.Array]) -> None:
    """Raises ConfigError if `inner` (named `what`), holding MultiSteps, updated no param in the probe's steps (a
    NaN it holds back shows as 0 x NaN: only finite non-zero updates count)."""
    if not any(np.any((np.asarray(u) != 0) & np.isfinite(u)) for u in reference):
        raise ConfigError(
            f"zero.path={path} cannot check {what}: it updated no param in {MULTI_STEPS_PROBE} steps (optax.MultiSteps "
            "or apply_every with k above that?). Accumulate grads with micro-batches (train.microbatches, "
            "build_zero(microbatches=)) or use zero.path=spec."
        )


def _run_with_state(inner, params, grads, groups) -> tuple[list[jax.Array], PyTree]:
    """Steps `inner` from `params` through `grads` (a list of steps): per param leaf its updates, [steps,
    *shape], and the state the steps leave. Up to PROBE_STEPS steps run one by one; more (MultiSteps')
    run the first alone and the others in a scan, one step's program whatever their number, from the state
    the first leaves, whose types no longer change (a count made by init may be weakly typed)."""

    def step(carry, g):
        params, state = carry
        u, state = inner_update(inner, g, state, params, groups)
        return (optax.apply_updates(params, u), state), jax.tree.leaves(u)

    carry, updates = (params, inner.init(params)), []
    for g in grads if len(grads) <= PROBE_STEPS else grads[:1]:
        carry, u = step(carry, g)
        updates.append([x[None] for x in u])
    if len(grads) > PROBE_STEPS:
        carry, rest = jax.lax.scan(step, carry, jax.tree.map(lambda *gs: jnp.stack(gs), *grads[1:]))
        updates.append(rest)
    return [jnp.concatenate(us) for us in zip(*updates)], carry[1]


def _run(inner, params, grads, groups) -> list[jax.Array]:
    """`_run_with_state`'s updates."""
    return _run_with_state(inner, params, grads, groups)[0]


def _scalars(state: PyTree, plan: ShardingPlan | None = None) -> list[jax.Array]:
    """The scalar leaves of an inner state but those of a param's own state (its path ends in the param's,
    looked up in `plan`: a scalar param's moments); a flat shard's state has none of those."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    kept = [x for path, x in leaves if jnp.ndim(x) == 0 and (plan is None or plan.param_of(tuple(path)) is None)]
    is_key = lambda x: jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
    return [jax.random.key_data(x) if is_key(x) else x for x in kept]  # a key compared by its bits


def _scalars_differ(a: list[jax.Array], b: list[jax.Array]) -> bool:
    """Whether two states' `_scalars` differ (beyond TOLERANCE; in which are finite); lists of another length
    (a state laid out otherwise) are not compared."""
    if len(a) != len(b):
        return False
    return any(_step_error(jnp.reshape(x, (1, -1)), jnp.reshape(y, (1, -1))) > TOLERANCE for x, y in zip(a, b))


def _on_slices(inner, params, grads, per_param: list[ParamGroup] | None) -> tuple[list[jax.Array], list]:
    """`_run` as the flat path would: the params concatenated, cut into 2 buckets, each
    bucket into 2 rank shards (cuts fall inside params), each rank stepping its own slices. Also each
    rank's state's `_scalars`."""
    leaves = jax.tree.leaves(params)
    sizes = [x.size for x in leaves]

    def cat(xs):
        return jnp.concatenate([x.reshape(-1) for x in xs]) if xs else jnp.zeros(0)

    n = sum(sizes)
    cuts = [0, n // 4, n // 2, (3 * n) // 4 + 1, n]  # bucket 0 = [0, n/2), bucket 1 = [n/2, n)

    def shards_of(v):  # per rank: [its shard of bucket 0, its shard of bucket 1]
        return [[v[cuts[r] : cuts[r + 1]], v[cuts[2 + r] : cuts[3 + r]]] for r in range(2)]

    flat_params = shards_of(cat(leaves))
    flat_grads = [shards_of(cat(jax.tree.leaves(g))) for g in grads]
    rank_groups = [None, None]
    if per_param is not None:
        lr = shards_of(cat([jnp.full(s, g.lr_mult) for s, g in zip(sizes, per_param)]))
        wd = shards_of(cat([jnp.full(s, g.wd_mult) for s, g in zip(sizes, per_param)]))
        rank_groups = [GroupValues(lr[r], wd[r]) for r in range(2)]
    runs = [_run_with_state(inner, flat_params[r], [g[r] for g in flat_grads], rank_groups[r]) for r in range(2)]
    out = [u for u, _ in runs]
    flat = jnp.concatenate([out[0][0], out[1][0], out[0][1], out[1][1]], axis=1)  # [steps, n]
    pieces = jnp.split(flat, np.cumsum(sizes)[:-1], axis=1)
    return [x.reshape(len(grads), *p.shape) for x, p in zip(pieces, leaves)], [_scalars(st) for _, st in runs]


def check_elementwise(inner: optax.GradientTransformation, plan: ShardingPlan, groups: PyTree | None = None) -> None:
    """Raises ConfigError unless `inner` updates a flat buffer's shards as it updates the params.

    Compares the probe's steps' updates (not the params, whose size would hide a difference in a
    small update), each step's per param, against the per-param run (module docstring).
    """
    multi = _multi_steps(inner, plan)
    params, grads = _miniature(plan, MULTI_STEPS_PROBE if multi else PROBE_STEPS)
    values = None if groups is None else per_param_values(groups)
    per_param = None if groups is None else group_leaves(groups)
    what = transformation_name(inner)
    use = (
        "Use zero.path=owned (each param stepped whole by one rank: Muon, Adafactor; docs/owned.md) or "
        "zero.path=spec (any optax transformation), or for per-param weight decay and lr multipliers "
        "jzero's param groups (jzero.zero.groups)."
    )
    # Op by op, not jitted: a jit of these small programs compiled each build anew (0.4-0.6 s), the ops' own
    # programs are compiled once per shape and reused (0.06 s a probe).
    reference, state = _run_with_state(inner, params, grads, values)
    if multi:
        _check_emits(what, "flat", reference)
    try:
        flat, rank_scalars = _on_slices(inner, params, grads, per_param)
    except Exception as e:  # a transformation built for the params' tree structure (labels, masks)
        raise ConfigError(
            f"zero.path=flat cannot run {what}: it fails on flat buffer shards ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]}). {use}"
        ) from None
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(plan.tensors)[0]]
    errors = {n: _step_error(a, b) for n, a, b in zip(names, flat, reference)}
    worst = max(errors, key=errors.get, default=None)
    if worst is not None and errors[worst] > TOLERANCE:
        how = "in which elements are finite" if math.isinf(errors[worst]) else f"by {errors[worst]:.1e} (relative)"
        raise ConfigError(
            f"zero.path=flat needs an element-wise optimizer, and {what} is not: on flat buffer shards its update "
            f"differs {how} (param {worst}); trust ratios, factored moments, per-tensor "
            f"masks, norms (clipping) and skips of non-finite updates inside the chain see one rank's slice of a "
            f"buffer there. {use}"
        )
    if any(_scalars_differ(r, _scalars(state, plan)) for r in rank_scalars):
        raise ConfigError(
            f"zero.path=flat needs an element-wise optimizer, and {what} is not: on flat buffer shards a scalar of "
            f"its state differs (a statistic over all params, as D-Adaptation's or Prodigy's learning-rate "
            f"estimate?), so its later updates would. {use}"
        )
    if _decides_by_size(inner, plan, values):
        raise ConfigError(
            f"zero.path=flat needs an element-wise optimizer, and {what} is not: its update for a param depends on "
            f"the param's size (a mask or rule on p.size?), and on flat buffer shards it would see a shard's. {use}"
        )


def _reads(fn, args: tuple, arg_index: int) -> bool:
    """Whether any output of `fn(*args)` depends on `args[arg_index]` (a jaxpr reachability walk)."""
    closed = jax.make_jaxpr(fn)(*args)
    n_before = sum(len(jax.tree.leaves(a)) for a in args[:arg_index])
    n_arg = len(jax.tree.leaves(args[arg_index]))
    marked = set(closed.jaxpr.invars[n_before : n_before + n_arg])
    for eqn in closed.jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in marked for v in eqn.invars):
            marked.update(eqn.outvars)
    return any(not isinstance(v, Literal) and v in marked for v in closed.jaxpr.outvars)


def check_runs(inner: optax.GradientTransformation, plan: ShardingPlan, groups: PyTree | None) -> None:
    """Raises ConfigError unless `inner`'s update runs as the step calls it: update(grads, state, params),
    with `param_groups=` where groups are given (`update.inner_update`), nothing else. A transformation
    that needs the loss (`value=`: optax.contrib.reduce_on_plateau, polyak_sgd) is refused here, by name,
    not at the first step. Traced only, on abstract arrays."""
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(t.shape), jnp.float32), plan.tensors)
    values = None if groups is None else per_param_values(groups)
    try:
        _trace_update(inner, abstract, values)
    except TypeError as e:
        if not _a_call_mismatch(e):  # raised inside the update: an argument of the wrong type, most likely
            raise ConfigError(
                f"{transformation_name(inner)} fails when it steps the params ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:160]}): check the arguments it was built with"
            ) from None
        raise ConfigError(
            f"{transformation_name(inner)} cannot run in a ZeRO step, which calls update(grads, state, params"
            f"{', param_groups=...' if groups is not None else ''}) and nothing more ({str(e).splitlines()[0][:160]}); "
            "a transformation that needs the loss (value=) is not supported"
        ) from None


def _a_call_mismatch(e: TypeError) -> bool:
    """Whether `e` says a function was called with arguments it does not take (Python's wording for a call
    that misses or adds an argument), not that an operation got a value of the wrong type."""
    return any(words in str(e) for words in ("argument", "takes no", "takes from", "positional"))


def check_not_lookahead(inner: optax.GradientTransformation, plan: ShardingPlan) -> None:
    """Raises ConfigError if `inner`'s state holds an `optax.LookaheadState` (`optax.lookahead`, alone or inside a
    chain): lookahead steps params wrapped as `optax.LookaheadParams(fast, slow)` and returns updates for both, while
    the step hands the transformation the plain params and applies its updates to them. Without this refusal it
    fails deep inside the build (`params.fast` of a dict; a pytree structure error with wrapped params). Decided by
    the state `inner.init` makes (abstract), not by a name; lookahead's warning that its params have no `fast`
    (absl logging) is held back meanwhile."""
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(t.shape), jnp.float32), plan.tensors)
    is_lookahead = lambda x: isinstance(x, optax.LookaheadState)  # noqa: E731
    absl = logging.getLogger("absl")
    quiet = logging.Filter("absl.never")  # a name no record has: drops every record while it is on
    absl.addFilter(quiet)
    try:
        state = jax.eval_shape(inner.init, abstract)
    except Exception:  # a transformation that cannot even initialize here: `check_runs` names its failure
        return
    finally:
        absl.removeFilter(quiet)
    if any(is_lookahead(x) for x in jax.tree.leaves(state, is_leaf=is_lookahead)):
        raise ConfigError(
            f"{transformation_name(inner)} cannot run in a ZeRO step: optax.lookahead needs its params wrapped as "
            "optax.LookaheadParams(fast, slow) and returns updates for both, while the step passes the optimizer "
            "the plain params and applies its updates to them; use lookahead's fast optimizer alone"
        )


def check_runs_owning_nothing(inner: optax.GradientTransformation, plan: ShardingPlan, ranks: int) -> None:
    """Raises ConfigError unless `inner` steps a tree of `optax.MaskedNode`s only, as a rank of the owned layout
    that owns no param does (more ranks than params to own): optax.contrib.galore fails there. Traced only."""
    treedef = jax.tree.structure(plan.tensors)
    try:
        _trace_update(inner, treedef.unflatten([optax.MaskedNode()] * treedef.num_leaves), None)
    except Exception as e:  # any failure of the user's chain on an empty tree
        raise ConfigError(
            f"zero.path=owned: some of the {ranks} ranks own no param here, and {transformation_name(inner)} fails "
            f"on a rank that owns none ({type(e).__name__}: {str(e).splitlines()[0][:120]}); use fewer DP ranks "
            "than params, or zero.path=spec"
        ) from None


def _trace_update(inner, params: PyTree, groups: GroupValues | None) -> None:
    """`inner`'s init and one update on `params` (abstract, or MaskedNodes) as the step calls it, traced."""
    jax.eval_shape(lambda p: inner_update(inner, p, inner.init(p), p, groups), params)


def check_groups_read(inner: optax.GradientTransformation, plan: ShardingPlan, groups: PyTree | None) -> None:
    """Raises ConfigError if `groups` sets a multiplier that `inner` never reads."""
    if groups is None:
        return
    params, grads = _miniature(plan)
    state = inner.init(params)
    values = per_param_values(groups)
    as_arrays = jax.tree.map(lambda v: jnp.float32(v), values)

    def update(lr_mult, wd_mult):
        return inner_update(inner, grads[0], state, params, GroupValues(lr_mult, wd_mult))[0]

    where = {"lr_mult": "scale_by_lr_mult() after the learning rate", "wd_mult": "add_decayed_weights(weight_decay)"}
    for i, field in enumerate(GroupValues._fields):
        if all(v == 1.0 for v in jax.tree.leaves(getattr(values, field))):
            continue
        if not _reads(update, tuple(as_arrays), i):
            raise ConfigError(
                f"param groups set {field} but {transformation_name(inner)} never reads it: put "
                f"jzero.zero.groups.{where[field]} in the chain (jzero.zero.groups.adamw has both), or pass no groups"
            )


def check_per_tensor(
    inner: optax.GradientTransformation, plan: ShardingPlan, owned, groups: PyTree | None = None
) -> frozenset[int]:
    """The stacked params `inner` must step whole (the leaves indices of those whose layers it couples);
    raises ConfigError unless it steps every other param alone as it steps it among all the params: each
    layer of a stacked one (where the owned layout owns it by layer: `owned.stacked`), and an expert param's
    first half of its experts (each ep rank steps its own experts' slice).

    The owned layout (`owned/layout.py`) steps each rank's params whole but without the others, which it
    hands the transformation as `optax.MaskedNode`s; a norm, clip or skip across params inside the chain
    would see only the rank's own. Compares the probe's steps' updates on the miniature (module docstring); and,
    traced only, the update program of each stacked or expert param at its shape against at the shape a
    rank holds of it (one layer; its ep slice), which a rule on a dim's size (Adafactor's factored dims)
    tells apart beyond the miniature. A stacked param that fails either only by its layers (Adafactor's
    block RMS over the whole stack) is returned, for its owner to hold it whole.
    """
    multi = _multi_steps(inner, plan)
    params, grads = _miniature(plan, MULTI_STEPS_PROBE if multi else PROBE_STEPS)
    values = None if groups is None else per_param_values(groups)
    leaves, treedef = jax.tree.flatten(params)
    tensors = jax.tree.leaves(plan.tensors)
    names = [t.name for t in tensors]
    ep = plan.mesh.shape["ep"]
    ep_dims = [next((k for k, e in enumerate(tuple(t.tp_spec)) if "ep" in entry_axes(e)), None) for t in tensors]

    def part(x, i, layer):  # the piece one rank steps of leaf i's miniature (or of its reference updates)
        lead = x.ndim - leaves[i].ndim  # the reference's [steps] dim
        if layer is not None:
            x = jax.lax.slice_in_dim(x, layer, layer + 1, axis=lead)
        if ep > 1 and ep_dims[i] is not None and leaves[i].shape[ep_dims[i]] > 1:
            x = jax.lax.slice_in_dim(x, 0, leaves[i].shape[ep_dims[i]] // 2, axis=lead + ep_dims[i])
        return x

    cases = [(i, layer) for i, x in enumerate(leaves) for layer in (range(x.shape[0]) if owned.stacked[i] else [None])]

    def alone(tree, i, layer):
        xs = treedef.flatten_up_to(tree)
        out = [optax.MaskedNode()] * len(xs)
        out[i] = part(xs[i], i, layer) if jnp.ndim(xs[i]) else xs[i]
        return treedef.unflatten(out)

    def runs(params, grads):
        reference, state = _run_with_state(inner, params, grads, values)
        each, scalars = [], []
        for i, layer in cases:
            vals = None if values is None else GroupValues(*(alone(v, i, layer) for v in values))
            u, st = _run_with_state(inner, alone(params, i, layer), [alone(g, i, layer) for g in grads], vals)
            each.append(u[0])
            scalars.append(_scalars(st, plan))
        return reference, each, _scalars(state, plan), scalars

    what = transformation_name(inner)
    try:
        reference, each, state_scalars, scalars = jax.jit(runs)(params, grads)
    except Exception as e:  # a transformation built for the whole tree's structure
        raise ConfigError(
            f"zero.path=owned cannot run {what}: it fails on one param alone ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]}). Use zero.path=spec."
        ) from None
    if multi:
        _check_emits(what, "owned", reference)
    whole = set()
    for (i, layer), alone_scalars in zip(cases, scalars):
        if _scalars_differ(alone_scalars, state_scalars):  # held whole or not, the owner's state is its own
            where = names[i] + ("" if layer is None else f" (layer {layer})")
            raise ConfigError(
                f"zero.path=owned steps each param whole and alone on its owner, and a scalar of {what}'s state "
                f"differs with param {where} alone (a statistic over all params, as D-Adaptation's or Prodigy's "
                "learning-rate estimate?), so its later updates would. Use zero.path=spec."
            )
    for (i, layer), u in zip(cases, each):
        if _step_error(u, part(reference[i], i, layer)) <= PER_TENSOR_TOLERANCE:
            continue
        if layer is not None and ep_dims[i] is None:  # its layers are coupled: its owner holds the stack whole
            whole.add(i)
            continue
        where = names[i] + ("" if layer is None else f" (layer {layer})")
        raise ConfigError(
            f"zero.path=owned steps each param whole and alone on its owner, and {what} steps param {where} "
            f"differently alone than among all params (a norm, clip or skip across params or experts inside "
            "the chain?). Clip with build_zero's clip_grad (the CLI's optimizer.clip_grad) instead, or use "
            "zero.path=spec."
        )
    for i, t in enumerate(tensors):
        held = list(owned.local_shapes[i])
        if owned.stacked[i]:
            held[0] = 1
        if i in whole or tuple(held) == t.shape:
            continue
        if _program_of(inner, treedef, i, t.shape) != _program_of(inner, treedef, i, held):
            if owned.stacked[i] and ep_dims[i] is None:
                whole.add(i)
                continue
            raise ConfigError(
                f"zero.path=owned: {what} builds another update for param {t.name} at its shape {t.shape} than at "
                f"the {tuple(held)} a rank holds of it (a rule on a dim's size, such as Adafactor's factored dims "
                "taking the expert dim), so it would train otherwise. Use zero.path=spec."
            )
    return frozenset(whole)


def _program_of(inner, treedef, i: int, shape) -> collections.Counter:
    """The primitives of `inner`'s first update of leaf `i` alone at `shape`, each with the dims it reduces,
    transposes or broadcasts (Adafactor factors other dims of another shape with the same primitives).
    Abstract: nothing is made."""
    spec = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
    tree = treedef.unflatten([spec if k == i else optax.MaskedNode() for k in range(treedef.num_leaves)])
    return _primitives(jax.make_jaxpr(lambda p, g: _run(inner, p, [g], None))(tree, tree).jaxpr, detail=True)
