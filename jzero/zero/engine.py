"""The one step engine: a ZeRO run's jitted step, grads and evaluate, built once from its `Layout`.

A layout (`zero.path`: `spec/layout.py`, `flat/layout.py`) says how each param's model copy, reduced
grad, fp32 main copy and optimizer state are laid over its DP domain, and supplies the traceable
programs that move them. The engine puts them in Megatron's order, the same for every layout:

    grads: the micro-batches in Megatron's schedule (`common/schedule.py`), each grad scaled
           (`common/batch.grad_scale`) and reduced by its unit's hook (`common/units.py`) with the HSDP
           rule of `common/collectives.py`
    -> the model state's update (`state.ModelState`; Megatron's `finalize_model_grads`)
    -> the offloaded optimizer state to device memory (`common/offload.py`)
    -> the optimizer update on each rank's main params (`common/update.py`) and the new params
    -> the offloaded state back to host memory

Adding a layout: a module that builds a `Layout` from `LayoutInputs`, registered in `build.LAYOUTS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.zero.common.batch import batch_sharding
from jzero.zero.common.compiler import step_compiler_options
from jzero.zero.common.offload import Offload
from jzero.zero.common.state import LossFn, ModelState, TrainState, state_optional
from jzero.zero.common.strategies import ShardingPlan
from jzero.zero.config import StepOptions, ZeroConfig

PyTree = Any


@dataclasses.dataclass(frozen=True)
class LayoutInputs:
    """What every layout is built from (`build.build_zero`'s arguments, resolved once).

    loss_fn: the user's loss; inner: the optax transformation; plan: the per-tensor shardings (its
    `stage`); config and options: the ZeRO config and the step's options; groups: per param its
    `groups.ParamGroup`, or None; model_state: the model's `ModelState`, or None; unit_key: the flat
    path's name of a unit param's unit, or None (its default).
    """

    loss_fn: LossFn
    inner: optax.GradientTransformation
    plan: ShardingPlan
    config: ZeroConfig
    options: StepOptions
    groups: PyTree | None
    model_state: ModelState | None
    unit_key: Callable[[tuple], str] | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one ZeRO run lays its tensors over the DP domain, and the traceable programs that move them.

    shardings: a TrainState of NamedShardings: the params as the state holds them, the optimizer state
      (offloaded leaves in host memory), the step, the model state (replicated).
    grad_shardings: of the reduced grads as `grads` returns them and the optimizer reads them.
    init_opt: the state's params -> `ZeroState`, traced under jit.
    grads: (params, batch, loss_scale, model_state) -> ((loss, metrics, stats), grads): the loss and
      metrics averaged over ranks and micro-batches, the model's stats summed over them (replicated), the
      grads of the loss x loss_scale (None: unscaled) reduced over DP; batch leaves `[B, ...]`.
    update: (params, opt_state, grads) -> (params, opt_state, metrics): the optimizer step, opt_state in
      device memory.
    evaluate: (params, batch, model_state) -> {"loss", **metrics}: the step's forward, without grads.
    offload: which optimizer-state leaves live in host memory between steps.
    to_state: the params tree -> what `TrainState.params` holds; None: the tree itself.
    to_model: the inverse of `to_state` (None with it).
    to_model_space, from_model_space: the optimizer state (device memory) -> per parameter in global
      shapes, and back; None: it is laid out per parameter already.
    grad_buffer: dtype -> the grad buffer the micro-batches accumulate into, as sharded ShapeDtypeStructs.
    flat: Megatron's flat buffers (`flat/plan.FlatPlan`) for a layout built on them, else None.
    owned: who owns which whole param (`owned/plan.OwnedPlan`) on the owned layout, else None.
    """

    shardings: TrainState
    grad_shardings: PyTree
    init_opt: Callable
    grads: Callable
    update: Callable
    evaluate: Callable
    offload: Offload
    grad_buffer: Callable
    to_state: Callable | None = None
    to_model: Callable | None = None
    to_model_space: Callable | None = None
    from_model_space: Callable | None = None
    flat: Any = None
    owned: Any = None


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of a run (`build.Zero`'s fields of the same names).

    step: (state, batch) -> (state, metrics), the state donated. grads: (params, batch, model_state=None)
    -> the reduced grads. evaluate: (params, batch, model_state=None) -> {"loss", **metrics}. (model_state
    None: the `ModelState`'s initial state, if any.)
    """

    step: Callable
    grads: Callable
    evaluate: Callable


def build_programs(
    layout: Layout, mesh: Mesh, config: ZeroConfig, options: StepOptions, model_state: ModelState | None
) -> Programs:
    """The jitted step, grads and evaluate of `layout` (module docstring)."""
    shardings, offload = layout.shardings, layout.offload

    def step(state: TrainState, batch: PyTree):
        scaler = state.opt_state.grad_scaler
        loss_scale = None if scaler is None else scaler.loss_scale
        (loss, metrics, stats), grads = layout.grads(state.params, batch, loss_scale, state.model_state)
        new_model_state, state_metrics = state.model_state, {}
        if model_state is not None:  # after the grads' reduction, before the optimizer (Megatron's order)
            new_model_state, state_metrics = model_state.update(state.model_state, stats)
        opt_state, grads = offload.to_device(state.opt_state, after=grads)
        params, opt_state, opt_metrics = layout.update(state.params, opt_state, grads)
        metrics = {"loss": loss, **opt_metrics, **metrics, **state_metrics}
        return TrainState(params, offload.to_host(opt_state), state.step + 1, new_model_state), metrics

    replicated, batch_sh, state_sh = NamedSharding(mesh, P()), batch_sharding(mesh), shardings.model_state
    step_jit = jax.jit(
        step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated), donate_argnums=0,
        compiler_options=step_compiler_options(mesh, config, options.microbatches) or None,
    )  # fmt: skip
    grads_jit = jax.jit(
        lambda params, batch, state: layout.grads(params, batch, None, state)[1],
        in_shardings=(shardings.params, batch_sh, state_sh), out_shardings=layout.grad_shardings,
    )  # fmt: skip
    eval_jit = jax.jit(layout.evaluate, in_shardings=(shardings.params, batch_sh, state_sh), out_shardings=replicated)
    grads_jit, eval_jit = (state_optional(f, model_state, state_sh) for f in (grads_jit, eval_jit))
    return Programs(step_jit, grads_jit, eval_jit)

