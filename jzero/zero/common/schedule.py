"""Megatron's micro-batch schedule, the one loop over micro-batches of every layout: each micro-batch's
role (`Phase`) and the loop over them (`run_schedule`).

  ZeRO-2/3: every micro-batch reduce-scatters into the sharded accumulator.
  DDP, ZeRO-1: the first M-1 micro-batches only accumulate this rank's own grads (no communication);
    the last one adds them before its reduction, so the wire bytes are one reduction's.
Where the params rest sharded (ZeRO-3; ZeRO-1/2 with `overlap_param_gather`) the forward gathers each
unit's; ZeRO-3 in every micro-batch, ZeRO-1/2 in the first only, which hands what it gathered to the
later ones: once per step. Where the stage reduces per unit (`Stage.per_unit`) each reduction runs inside
the micro-batch's backward, per FSDP unit; else every param is in no unit and is reduced when its
backward is complete.

A layout supplies `run(phase, params, mb, acc=None) -> (loss, metrics, grads, extracted)`, one micro-batch
`mb` in `phase`: grads reduced (or this rank's own, when the phase does not reduce), and the gathered
params when it extracts (else None).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jzero.zero.common.unit_check import check_loss
from jzero.zero.common.units import micro_batch_loss
from jzero.zero.config import Stage

PyTree = Any


class Phase(enum.Enum):
    """A micro-batch's role in the schedule (module docstring). What it does follows from the role and
    the `Stage`: `gathers`, `reduces`, `extracts`, `adds_carry`, `stacked`."""

    ALIKE = "alike"  # every micro-batch alike (ZeRO-3, ZeRO-2 without overlap_param_gather, M = 1)
    FIRST = "first"  # the first of several: gathers where the params rest sharded and hands them on
    MIDDLE = "middle"  # a later one: computes with what the first handed on
    LAST = "last"  # DDP/ZeRO-1's last: adds the grads accumulated so far before its reduction

    def gathers(self, stage: Stage) -> bool:
        """The params enter as they rest sharded and are gathered per unit."""
        return self in (Phase.ALIKE, Phase.FIRST) and stage.params_rest_sharded

    def reduces(self, stage: Stage) -> bool:
        """Each grad is reduced over DP in the backward; False: the sink gets this rank's own."""
        return self in (Phase.ALIKE, Phase.LAST) or stage.shards_grads

    def extracts(self, stage: Stage) -> bool:
        """The gathered params come out beside the grads (ZeRO-1/2's first micro-batch)."""
        return self == Phase.FIRST and _hands_on(stage)

    @property
    def adds_carry(self) -> bool:
        """The rank's grads accumulated so far are added before the reduction."""
        return self == Phase.LAST

    def stacked(self, stage: Stage) -> bool:
        """The params enter as what the first micro-batch extracted (each rank's gathered copy)."""
        return self in (Phase.MIDDLE, Phase.LAST) and _hands_on(stage)


def backward(loss_at: Callable[[PyTree], tuple], view: Callable, sinks: PyTree, gsinks: PyTree) -> tuple:
    """One micro-batch's backward, the same in every layout: `loss_at(view(sinks, gsinks)) -> (value, aux)`
    differentiated with respect to the sinks (and gsinks), whose cotangents the unit hooks fill with the
    reduced grads (and the gathered params). The loss's jaxpr is checked first (`unit_check.check_loss`) and
    the carries it finds outside once-per-step calls are added by `units.micro_batch_loss`.
    Returns (aux, (grads, gathered params or None))."""
    outside = check_loss(loss_at, view(sinks, gsinks))

    def loss_of(sinks, gsinks):
        return micro_batch_loss(loss_at, view(sinks, gsinks), outside)

    (_, aux), grads = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(sinks, gsinks)
    return aux, grads


def _hands_on(stage: Stage) -> bool:
    """ZeRO-1/2 with the params resting sharded gather them in the first micro-batch only."""
    return stage.params_rest_sharded and not stage.shards_params


def run_schedule(
    run: Callable, params: PyTree, mbs: PyTree, stage: Stage, zeros: Callable[[], PyTree],
    reduce_after: Callable[[PyTree], PyTree] | None = None,
) -> tuple[jax.Array, PyTree, PyTree]:  # fmt: skip
    """The micro-batches `mbs` ([M, ...] leaves) in their `Phase`s (module docstring): (losses [M, ...],
    metrics [M, ...], reduced grads). zeros(): the reduced grads' zeros, which micro-batches that all
    reduce alike sum into. reduce_after: for DDP and ZeRO-1, the layout reduces the accumulated local
    grads itself, once, after the last micro-batch (the spec layout where no param is in a unit); None:
    the last micro-batch's backward does."""
    m = jax.tree.leaves(mbs)[0].shape[0]
    if reduce_after is not None and not stage.shards_grads:
        return _accumulated(run, params, mbs, reduce_after)
    each = stage.shards_grads or m == 1  # every micro-batch reduces (ZeRO-2/3), or the only one does
    if each and (m == 1 or not _hands_on(stage)):
        return _alike(run, params, mbs, zeros, stage)
    first = Phase.FIRST
    loss, metrics, g, full = run(first, params, jax.tree.map(lambda x: x[0], mbs))
    if each and m > 1:  # XLA:GPU would fold rs(first) + rs(next) into rs(first + next): a whole local grad
        g = jax.lax.optimization_barrier(g)  # buffer for what is not in a unit (embedding, head) at M = 2
    params = full if first.extracts(stage) else params
    losses, metrics = [loss[None]], [jax.tree.map(lambda x: x[None], metrics)]
    middle = mbs if each else jax.tree.map(lambda x: x[:-1], mbs)  # [1:] of these run alike
    if jax.tree.leaves(middle)[0].shape[0] > 1:
        g, loss, metric = _accumulate(run, Phase.MIDDLE, params, jax.tree.map(lambda x: x[1:], middle), g, False)
        losses, metrics = losses + [loss], metrics + [metric]
    if not each:  # DDP / ZeRO-1: the last micro-batch adds the accumulated grads and reduces
        loss, metric, g, _ = run(Phase.LAST, params, jax.tree.map(lambda x: x[-1], mbs), g)
        losses, metrics = losses + [loss[None]], metrics + [jax.tree.map(lambda x: x[None], metric)]
    cat = lambda *xs: jnp.concatenate(xs)  # noqa: E731
    return jnp.concatenate(losses), jax.tree.map(cat, *metrics), g


def _accumulated(run, params, mbs, reduce_after):
    """Every micro-batch only accumulates (the first, then the others in a scan), then `reduce_after`."""
    loss, metrics, g, _ = run(Phase.FIRST, params, jax.tree.map(lambda x: x[0], mbs))
    losses, metrics = [loss[None]], [jax.tree.map(lambda x: x[None], metrics)]
    if jax.tree.leaves(mbs)[0].shape[0] > 1:
        g, loss, metric = _accumulate(run, Phase.MIDDLE, params, jax.tree.map(lambda x: x[1:], mbs), g, False)
        losses, metrics = losses + [loss], metrics + [metric]
    cat = lambda *xs: jnp.concatenate(xs)  # noqa: E731
    return jnp.concatenate(losses), jax.tree.map(cat, *metrics), reduce_after(g)


def _accumulate(run, phase, params, mbs, acc, gathers):
    """`phase` over the micro-batches `mbs` [k, ...] in a scan, its grads summed into `acc`: (acc, losses
    [k, ...], metrics).

    A phase that gathers (ZeRO-3) carries the params through the scan behind an optimization barrier,
    so that each micro-batch's gathers read a value the micro-batch before produced and cannot start
    before it. XLA:GPU's collective pipeliner would otherwise start a micro-batch's first gathers in
    the one before, which it does by peeling a whole micro-batch out of the loop, and XLA then keeps
    that micro-batch's zero-initialised grad stack live across the loop. Measured on LLaMA-2-7B's
    ZeRO-3 step at 8 micro-batches on 8 x H100 (docs/overlap.md): device peak 30.85 -> 23.40 GiB,
    against 23.63 GiB with overlap off; the layer loops inside still prefetch their own gathers."""

    def body(carry, mb):
        acc, p = carry
        loss, metrics, g, _ = run(phase, params if p is None else p, mb)
        p = None if p is None else jax.tree.map(jax.lax.optimization_barrier, p)
        return (jax.tree.map(jnp.add, acc, g), p), (loss, metrics)

    (acc, _), (losses, metrics) = jax.lax.scan(body, (acc, params if gathers else None), mbs)
    return acc, losses, metrics


def _alike(run, params, mbs, zeros, stage):
    """Every micro-batch `Phase.ALIKE` (it reduces): one run, or a scan summing into `zeros()`."""
    if jax.tree.leaves(mbs)[0].shape[0] == 1:
        loss, metrics, g, _ = run(Phase.ALIKE, params, jax.tree.map(lambda x: x[0], mbs))
        return loss[None], jax.tree.map(lambda m: m[None], metrics), g
    acc, losses, metrics = _accumulate(run, Phase.ALIKE, params, mbs, zeros(), Phase.ALIKE.gathers(stage))
    return losses, metrics, acc
