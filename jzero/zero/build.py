"""The one entry to `jzero.zero`: `build_zero` resolves a ZeRO run once and returns a `Zero`.

Everything a harness, a checkpointer or an inspection tool needs is built here, once: the stage
(`config.Stage`), the per-tensor ShardingPlan, the run's layout (`LAYOUTS[zero.path]`: its shardings,
programs and conversions), the jitted step, grads and evaluate (`engine.build_programs`), and the
conversions of the params and the optimizer state to and from model space (for checkpoints).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import optax
from jax.sharding import Mesh, NamedSharding

from jzero.errors import ConfigError
from jzero.zero.common.batch import batch_sharding
from jzero.zero.common.offload import Offload
from jzero.zero.common.probe import check_groups_read, check_not_lookahead, check_runs
from jzero.zero.common.state import LossFn, ModelState, TrainState, ZeroState, init_train_state
from jzero.zero.common.strategies import ShardingPlan, make_plan
from jzero.zero.config import DynamicLossScale, SpikeGuard, StepOptions, ZeroConfig, ZeroPath
from jzero.zero.engine import Layout, LayoutInputs, build_programs
from jzero.zero.flat.layout import flat_layout
from jzero.zero.flat.plan import FlatPlan
from jzero.zero.owned.layout import owned_layout
from jzero.zero.spec.layout import spec_layout
from jzero.zero.spec.optimizer import opt_state_shardings

PyTree = Any
# The layouts of the engine, by `zero.path`: each builds a `Layout` from the run's `LayoutInputs`.
LAYOUTS: dict[ZeroPath, Callable[[LayoutInputs], Layout]] = {
    ZeroPath.SPEC: spec_layout, ZeroPath.FLAT: flat_layout, ZeroPath.OWNED: owned_layout,
}


@dataclasses.dataclass(frozen=True)
class Zero:
    """One ZeRO run, resolved.

    Attributes:
      config: the ZeroConfig it was built with (strategy, path, buckets, reshard, HSDP, gather, offload).
      options: the step's options it was built with (microbatches, grad reduce dtype, clipping,
        loss scaling, has_aux): `build_zero`'s keyword arguments.
      plan: the per-tensor shardings (`strategies.ShardingPlan`; its `stage`, `config.Stage`).
      layout: the run's layout (`engine.Layout`): its shardings, traceable programs and conversions.
      flat: Megatron's flat buffers on the flat path (per FSDP unit where the stage reduces per unit;
        `flat/plan.py`), None on the spec path.
      inner: the wrapped optax transformation.
      groups: per param its `groups.ParamGroup`, or None (no multipliers).
      shardings: a TrainState of NamedShardings (params tp-sharded, replicated over DP or split
        over it where they rest sharded; on the flat path there one array per flat bucket, see
        `full_params`; optimizer state per the strategy and path; step replicated).
      init_opt: the state's params -> ZeroState, to call under jit (see `init_state`).
      step: jitted (state, batch) -> (state, {"loss", "grad_norm"}); batch leaves `[B, ...]`
        split over the dense DP domain (`batch_sharding`); the state is donated.
      grads: jitted (state params, batch, model_state=None) -> the reduced grads as the optimizer reads them (spec:
        per param in `plan.state_shardings()`; flat: one array per bucket, [tp, S_b] dense or
        [ep * tp, S_b] expert ([L, ...] a scanned stack's), split over the bucket's DP domain
        unless no_shard), of the loss
        unscaled: with fp16 params small ones may underflow where the step's scaled ones do not.
      model_opt_shardings: the NamedShardings of the optimizer state in model space (the
        spec path's layout, all in device memory), where `to_model_space` puts it.
      evaluate: jitted (state params, batch, model_state=None) -> {"loss", **metrics} replicated: the loss as the step
        computes it (per rank, per microbatch, ZeRO-3 gathering each unit), without grads; for
        the same params and batch it is the step's "loss".
      offload: which optimizer-state leaves live in host memory (`common/offload.py`; their
        `shardings` have memory kind `pinned_host`); inactive at `zero.offload_fraction` 0.
      to_state: the params tree -> what `TrainState.params` holds, None where that is the tree.
      model_state: the model's non-trainable state (`state.ModelState`: init and update), or None.

    `TrainState.params` is the params tree on the spec path and wherever the flat path keeps the
    params whole (DDP; ZeRO-1/2 without `overlap_param_gather`). Where the flat path's params rest
    sharded (ZeRO-3; ZeRO-1/2 with `overlap_param_gather`, the default with overlap) it holds one
    array per flat bucket instead, which the step's forward gathers per unit; `full_params(state.params)`
    reads them as the params tree (checkpoints, `jzero layout` readers and users do), `params_from_model`
    is its inverse, and `evaluate`, `grads` and `init_opt` take what the state holds.
    """

    config: ZeroConfig
    options: StepOptions
    plan: ShardingPlan
    layout: Layout
    inner: optax.GradientTransformation
    groups: PyTree | None
    model_opt_shardings: ZeroState
    model_state: ModelState | None
    step: Callable  # these three: the engine's `Programs`
    grads: Callable
    evaluate: Callable

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    @property
    def flat(self) -> FlatPlan | None:
        return self.layout.flat

    @property
    def shardings(self) -> TrainState:
        return self.layout.shardings

    @property
    def init_opt(self) -> Callable[[PyTree], ZeroState]:
        return self.layout.init_opt

    @property
    def offload(self) -> Offload:
        return self.layout.offload

    @property
    def to_state(self) -> Callable | None:
        return self.layout.to_state

    @property
    def batch_sharding(self) -> NamedSharding:
        return batch_sharding(self.plan.mesh)

    def init_state(self, init_params: Callable[[], PyTree]) -> TrainState:
        """The train state from `init_params()` (traced), and the model state's `init()`, born in its shardings."""
        return init_train_state(init_params, self.init_opt, self.shardings, self.to_state, self.model_state)

    @property
    def model_param_shardings(self) -> PyTree:
        """The NamedShardings of the params tree in model space, where `full_params` puts it and
        checkpoints hold it: tp-split; replicated over DP, or split over the inner DP axes where the
        params rest sharded (`strategies.ShardingPlan.param_shardings`)."""
        return self.plan.param_shardings()

    @property
    def params_in_state(self) -> bool:
        """Whether `TrainState.params` is the params tree itself (else the flat path's resting bucket shards)."""
        return self.to_state is None

    def full_params(self, params: PyTree) -> PyTree:
        """What `TrainState.params` holds -> the params tree (global shapes, model dtypes), in
        `model_param_shardings`: the params themselves on the spec path and where the flat path keeps them
        whole; its resting bucket shards laid back into the params (`flat/state.to_model_params`) under ZeRO-3
        and ZeRO-1/2 with `overlap_param_gather`. Jitted; read `state.params` through it."""
        if self.params_in_state:
            return params
        return self._conversions[0](params)

    @functools.cached_property
    def _conversions(self) -> tuple[Callable, Callable]:
        """`full_params`'s and `params_from_model`'s jitted conversions, built once."""
        to_model = jax.jit(self.layout.to_model, out_shardings=self.model_param_shardings)
        from_model = jax.jit(self.layout.to_state, out_shardings=self.shardings.params)
        return to_model, from_model

    def params_from_model(self, params: PyTree) -> PyTree:
        """Inverse of `full_params`: the params tree -> what `TrainState.params` holds, in `shardings.params`."""
        if self.params_in_state:
            return params
        return self._conversions[1](params)

    def to_model_space(self, opt_state: ZeroState) -> ZeroState:
        """The optimizer state per parameter in global shapes, in device memory (identity on the spec
        path without offload); traceable."""
        opt_state, _ = self.offload.to_device(opt_state)
        return opt_state if self.layout.to_model_space is None else self.layout.to_model_space(opt_state)

    def from_model_space(self, opt_state: ZeroState) -> ZeroState:
        """Inverse of `to_model_space`; traceable."""
        return opt_state if self.layout.from_model_space is None else self.layout.from_model_space(opt_state)

    @property
    def keeps_main_params(self) -> bool:
        """Whether the state holds fp32 main params beside the model params (`state.keeps_main_params`)."""
        return self.model_opt_shardings.main_params is not None

    def grad_buffer_structs(self, dtype=None) -> PyTree:
        """The grad buffer the microbatches accumulate into, as sharded ShapeDtypeStructs in `dtype`
        (default: the grad reduce dtype it was built with).

        Full local grads per device under DDP and ZeRO-1, the owned shard under ZeRO-2
        (`strategies.ShardingPlan.grad_buffer_shardings`; flat path: one array per bucket of
        every buffer, [tp, S_b] dense and [ep * tp, S_b] expert, `FlatPlan.bucket_specs`).
        """
        return self.layout.grad_buffer(self.options.grad_reduce_dtype if dtype is None else dtype)


def xla_crashes_on_empty_params(jaxlib_version: str) -> bool:
    """Whether this jaxlib's XLA crashes (a segfault, no message) compiling a ZeRO step that holds a
    param of 0 elements: jaxlib 0.11.2 on every strategy and path (its SPMD partitioner: the
    zero-sized-HLO elimination turns a shard_map's 0-size operands into constants, and the
    conditional canonicalizer after it crashes); 0.10.2 compiles it (docs/xla.md, "Supported JAX
    versions")."""
    return jaxlib_version.startswith("0.11.")


def check_empty_params(abstract_params: PyTree, jaxlib_version: str) -> None:
    """Raises ConfigError for a param of 0 elements where jaxlib's XLA would crash on it
    (`xla_crashes_on_empty_params`): a refusal where the run is built, not a crash later."""
    if not xla_crashes_on_empty_params(jaxlib_version):
        return
    for path, p in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        if math.prod(p.shape) == 0:
            raise ConfigError(
                f"param {jax.tree_util.keystr(path)} has shape {tuple(p.shape)}, 0 elements: jaxlib "
                f"{jaxlib_version}'s XLA crashes compiling a ZeRO step that holds one (0.10.2 compiles it); "
                "leave it out of the params or use jaxlib 0.10.2"
            )


def build_zero(
    loss_fn: LossFn,
    inner: optax.GradientTransformation,
    mesh: Mesh,
    abstract_params: PyTree,
    tp_specs: PyTree,
    zero: ZeroConfig = ZeroConfig(),
    *,
    is_expert: PyTree | None = None,
    units: PyTree | None = None,
    unit_key: Callable[[tuple], str] | None = None,
    groups: PyTree | None = None,
    clip_grad: float | None = None,
    microbatches: int = 1,
    grad_reduce_dtype=jnp.float32,
    has_aux: bool = False,
    loss_scale: DynamicLossScale | None = None,
    model_state: ModelState | None = None,
    skip_nonfinite: bool = False,
    spike_guard: SpikeGuard | None = None,
) -> Zero:
    """Resolves a ZeRO run of `loss_fn` with the optimizer `inner` on `mesh`.

    Arguments:
      loss_fn: (params, batch) -> mean loss over the batch (with `has_aux`: (loss, metrics),
        a dict of scalars). The spec path calls it on global params under jit; the flat
        path on tp-local params inside shard_map, where, if a tp spec splits any param, it
        also gets `tp_axis=` the mesh's tp axis to sum its row-parallel outputs over. If
        some param is split over ep (expert weights, `is_expert`), both paths call it with
        `ep_axis=` the mesh's ep axis: each rank then holds its local experts and sends the
        tokens they need over that axis (all_to_all), as `jzero.train.moe` does.
      inner: any optax transformation on the spec path; an element-wise one on the flat
        path (others raise ConfigError naming the transformation).
      mesh: the (dp_outer, dp, ep, tp) mesh (`jzero.mesh.make_mesh`).
      abstract_params: params or ShapeDtypeStructs (global shapes, model dtypes).
      tp_specs: same structure, each param's tensor-parallel PartitionSpec (P() if none).
      zero: strategy, path and flat-buffer options (checked when it was built).
      is_expert: same structure, True for expert params (default: all dense).
      units: same structure, per param None (in no FSDP unit) or its number of leading
        stacked-layer dims: 0 for one block's param, 1 for a `scan`ned stack [L, ...]. The
        loss must run each unit through `jzero.zero.unit` (`GPTModel.units` marks its
        blocks). Under ZeRO-2/3 (and DDP/ZeRO-1 with `overlap_grad_reduce`) a unit's grads are
        then reduced as soon as its backward is done, and ZeRO-3 gathers its params just
        before it runs. Default: no units (ZeRO-3 gathers every param before the loss, ZeRO-2
        reduces after backward).
      unit_key: the flat path's name of a unit param's unit, from its key path (as
        `jax.tree_util.tree_flatten_with_path` gives it); it lays out one set of buffers per unit,
        and a `unit` call must get all of a unit's params. Default `flat/plan.unit_key`: the path up
        to its first integer key (`blocks/3`), else to its first Linen-numbered key (`params/blocks_3`,
        `params/Block_3`), else its first key (`blocks`, a scanned stack; never Flax's `params` alone). Pass one
        where the blocks are not a list or stack of their own (`{"enc": {"a": block, "b": block}}`,
        params in a top-level tuple), e.g. `lambda path: jax.tree_util.keystr(path[:2])`.
      groups: per param a `groups.ParamGroup` (e.g. from `groups.param_groups`), or None.
      clip_grad: global-norm clipping across shards (Megatron's), None = off.
      microbatches: gradient accumulation steps per `step`.
      grad_reduce_dtype: dtype of the grad buffer and its DP reduction.
      has_aux: `loss_fn` returns (loss, metrics); the step's metrics then hold each one's
        mean over ranks and microbatches.
      loss_scale: dynamic loss scaling (fp16 params; `DynamicLossScale`): the step
        differentiates loss x scale, unscales the reduced grads in fp32, skips the whole update
        when any is inf/nan, and reports `loss_scale` and `skipped`. None: off.
      model_state: the model's non-trainable state (`state.ModelState`): `loss_fn` is then called
        with `model_state=` the state and returns (loss, metrics, stats); the step sums the stats
        over the DP ranks and micro-batches and, after the grads' reduction and before the
        optimizer step, updates the state by `model_state.update` (its metrics join the step's).
        The state is replicated, in `TrainState.model_state`. None: the loss has no state.
      skip_nonfinite: a step whose grad norm is inf or nan keeps the old params and optimizer state
        (Megatron's --check-for-nan-in-loss-and-grad; metric `skipped`).
      spike_guard: a step whose grad norm exceeds `factor` x the mean of the last `window` ones keeps
        them too (`SpikeGuard`; metrics `skipped` and `spike_skipped`; the history is in
        `ZeroState.spike` and checkpoints). None: off, and the step is the same program.
    """
    options = StepOptions(
        microbatches, grad_reduce_dtype, clip_grad, loss_scale, has_aux, skip_nonfinite, spike_guard
    )
    for path, p in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        if not jnp.issubdtype(p.dtype, jnp.floating):  # plain optax cannot train it either (a float0 grad)
            raise ConfigError(
                f"param {jax.tree_util.keystr(path)} is {jnp.dtype(p.dtype).name}: a ZeRO step trains floating-point "
                "params only (it would keep an fp32 main copy of it, decay and cast it back); keep counters and "
                "other non-float values out of the params"
            )
    if loss_scale is None and any(jnp.dtype(p.dtype) == jnp.float16 for p in jax.tree.leaves(abstract_params)):
        raise ConfigError(
            "float16 params need loss scaling (their grads underflow without it): pass "
            "loss_scale=jzero.zero.DynamicLossScale() to build_zero"
        )
    leaves = jax.tree.leaves(abstract_params)
    if sum(math.prod(p.shape) for p in leaves) == 0:  # Megatron's bytes per param (`jzero.zero.memory`) divide by it
        what = f"its {len(leaves)} params have 0 elements each" if leaves else "it has no params"
        raise ConfigError(f"the model has no parameter elements ({what}): a ZeRO step has nothing to train")
    check_empty_params(abstract_params, jaxlib.__version__)
    plan = make_plan(mesh, zero.stage, abstract_params, tp_specs, is_expert, units, zero.outer_strategy)
    check_not_lookahead(inner, plan)
    check_runs(inner, plan, groups)
    check_groups_read(inner, plan, groups)
    model_opt_sh = opt_state_shardings(inner, plan, loss_scale, zero.param_gather_dtype is not None, spike_guard)
    inputs = LayoutInputs(loss_fn, inner, plan, zero, options, groups, model_state, unit_key)
    layout = LAYOUTS[zero.path](inputs)
    programs = build_programs(layout, mesh, zero, options, model_state)
    return Zero(
        zero, options, plan, layout, inner, groups, model_opt_sh, model_state, programs.step, programs.grads,
        programs.evaluate,
    )  # fmt: skip
