"""Plain-language reasons where the compiled program departs from the theory: what a platform's
XLA does (XLA:CPU's promoted bf16 collectives, its missing reduce-scatter pass, its hoisted
gathers), what the layout adds (padding, tensors left replicated, tp-joint shards), and what the
loops repeat. Each note is one line of `jzero hlo`'s text and one string of `notes` in its JSON."""

from __future__ import annotations

import jax

from jzero import model as protocol
from jzero.config import GPT_IMPL
from jzero.inspect import hlo
from jzero.inspect.comms.records import CollectiveRow, Theory, Traffic
from jzero.inspect.compile import CPU
from jzero.mesh import BATCH_AXES, axes_size, entry_axes
from jzero.zero.common.strategies import restrict
from jzero.zero.config import ZeroPath
from jzero.zero.memory import flat_numel_by_domain


def collect(c, static: Traffic, per_step: Traffic, theory: Theory, rows: list[CollectiveRow]) -> list[str]:
    """The notes on the compiled step `c`: its traffic per instruction (`static`) and `per_step`, its
    `theory` and its collectives' `rows`."""
    return [
        *_dtypes(c, rows),
        *_reduce_scatter(c, static, theory),
        *_loops(c, per_step, theory),
        *_layout(c),
        *_attention(c),
        *(["axes '-': a group of one device (a size-1 mesh axis, e.g. tp=1): no bytes move"]
          if any(not r.axes for r in rows) else []),
    ]  # fmt: skip


CUDNN_ATTENTION = "__cudnn$fmha"  # the custom-call targets of cuDNN's fused attention, forward and backward


def _attention(c) -> list[str]:
    """Which attention kernel a GPU program of bf16/fp16 activations runs (jzero's GPT: `model.attention`)."""
    text = c.compiled.as_text()
    fused = text.count(f'custom_call_target="{CUDNN_ATTENTION}')
    if fused:
        return [f"attention: cuDNN's fused kernel ({fused} {CUDNN_ATTENTION}* custom calls), no [B, H, T, T] scores"]
    dtype = c.cfg.precision.param_dtype.value
    if c.cfg.model.impl == GPT_IMPL and c.target != CPU and dtype != "float32":
        m = c.cfg.model
        why = (
            "model.attention=xla"
            if m.attention.value == "xla"
            else f"head dim {m.d_model // m.n_heads}; cuDNN's fused kernel takes multiples of 8 up to 128"
        )
        return [f"attention: XLA's, holding [B, H, T, T] scores ({why})"]
    return []


def _dtypes(c, rows: list[CollectiveRow]) -> list[str]:
    """XLA:CPU moves bf16 collectives as f32."""
    out = []
    param_dtype = c.cfg.precision.param_dtype.value
    gathered = {d for r in rows if r.kind == "all-gather" and hlo.is_dp_traffic(r.kind, r.axes) for d in r.dtypes}
    gathers_params = c.run.zero.plan.stage.shards_state  # DDP's all-gathers (under HSDP) move reduced grads
    if param_dtype != "float32" and "f32" in gathered and gathers_params and c.cfg.zero.param_gather_dtype is None:
        out.append(
            f"the params are all-gathered in f32, not {param_dtype}: XLA:CPU promotes bf16 collectives to f32 "
            "(ZeRO-3's gathers of the bf16 params too) or gathers the fp32 main params and casts after; XLA:GPU "
            "gathers bf16. Twice the theory's bytes for the gathers"
        )
    moved = {d for r in rows if r.kind == "all-to-all" for d in r.dtypes}
    if param_dtype != "float32" and "f32" in moved:
        out.append(
            f"the tokens' all-to-all moves f32, not {param_dtype} (seen on XLA:CPU, which promotes bf16 "
            "collectives; XLA:GPU keeps bf16): twice the tokens theory's bytes"
        )
    return out


def _reduce_scatter(c, static: Traffic, theory: Theory) -> list[str]:
    """The theory reduce-scatters what the program all-reduces."""
    if not theory.by_kind.get("reduce-scatter") or static.dp_wire_bytes_by_kind.get("reduce-scatter"):
        return []
    if not c.run.zero.plan.stage.shards_state:  # DDP under HSDP
        return [
            "no reduce-scatter: DDP's grads are all-reduced over the whole DP domain in one collective, not "
            "hierarchically (the same bytes per device, in one collective spanning dp_outer); zero.overlap_grad_reduce "
            "(the default) reduces inside the inner axes, then across dp_outer"
        ]
    if c.target == CPU:
        why = (
            "XLA:CPU has no reduce-scatter pass, docs/xla.md; zero.overlap_grad_reduce (the default), --path flat "
            "or a GPU target shows it"
        )
    elif c.run.zero.plan.hsdp:
        why = (
            "XLA:GPU too: under HSDP the spec path sums the grads over the whole DP domain into a sharding "
            "split over the inner axes only, which XLA does not turn into a reduce-scatter; "
            "zero.overlap_grad_reduce (the default) or --path flat reduces hierarchically"
        )
    else:
        why = "XLA kept the all-reduce; zero.overlap_grad_reduce (the default) or --path flat shows the reduce-scatter"
    return [f"no reduce-scatter: the grads are all-reduced in full, then each rank slices its shard ({why})"]


def _loops(c, per_step: Traffic, theory: Theory) -> list[str]:
    """What the micro-batch loop and the units' recompute repeat, beside the theory."""
    out = []
    cfg, plan, micro = c.cfg, c.run.zero.plan, c.cfg.train.microbatches
    if micro > 1 and plan.stage.shards_grads:
        out.append(
            f"the grads are reduced in the micro-batch loop, {micro}x per step"
            + (" (and the units' params gathered)" if plan.stage.shards_params else "")
            + "; `count` and `wire/device` are per instruction, `runs`, `wire/step` and the theory per step"
        )
    gather_th = theory.by_kind.get("all-gather", 0.0)
    gather_step = per_step.dp_wire_bytes_by_kind.get("all-gather", 0.0)
    remat = protocol.remat(c.run.model)
    if plan.stage.shards_params and cfg.zero.reshard_after_forward and remat and gather_step > 1.001 * gather_th:
        out.append(
            f"the all-gathers move {gather_step / gather_th:.2f}x the theory's: model.remat's recompute already "
            "gathers each unit's params again for its backward, and zero.reshard_after_forward's checkpoint, "
            "nested inside it, gathers some of them a third time; with model.remat, "
            "zero.reshard_after_forward=false gathers each unit twice"
        )
    if plan.stage.shards_params and micro > 1 and c.target == CPU and gather_step < 0.999 * gather_th:
        out.append(
            "fewer all-gather bytes than the theory: XLA:CPU hoists the gather of the params outside the units "
            f"(embeddings, final norm, head) out of the micro-batch loop, once per step, not {micro}x "
            "(XLA:GPU gathers them per micro-batch, as the theory)"
        )
    return out


def _joint_with_tp(plan, t) -> bool:
    """Whether the spec path splits `t`'s DP shard dim jointly with a model-parallel axis of size > 1
    (a tp-split dim no free dim could replace, e.g. a small bias): its per-unit collectives then
    run on the tp-gathered tensor (`units.Hook.tp_spec` None)."""
    if t.shard_dim is None or plan.mesh is None:
        return False
    model_axes = tuple(a for a in plan.mesh.axis_names if a not in BATCH_AXES)
    spec = tuple(restrict(t.tp_spec, model_axes)) + (None,) * len(t.shape)
    entry = spec[t.shard_dim]
    return axes_size(plan.mesh, entry_axes(entry)) > 1


def _layout(c) -> list[str]:
    """What the layout adds: tp-joint shards, tensors left replicated, the flat buffers' padding."""
    out = []
    cfg, plan = c.cfg, c.run.zero.plan
    spec_units = plan.stage.shards_grads and cfg.zero.path == ZeroPath.SPEC
    joint = [t for t in jax.tree.leaves(plan.tensors) if spec_units and _joint_with_tp(plan, t)]
    if joint:
        names = ", ".join(t.name for t in joint[:3]) + (", ..." if len(joint) > 3 else "")
        out.append(
            f"{len(joint)} tensor(s) split over DP jointly with tp on one dim ({names}): XLA gathers each over "
            "the model-parallel axes before its DP reduce-scatter (and gathers it over DP whole), so those "
            "collectives move the tensor's whole dim, not its tp-local part (a few bytes above the theory)"
        )
    replicated = plan.replicated()
    if replicated:
        out.append(
            f"{len(replicated)} tensor(s) have no dim divisible by the DP size and stay replicated "
            f"({', '.join(n for n, _ in replicated[:3])}{', ...' if len(replicated) > 3 else ''}): their grads "
            "are all-reduced, 2(d-1)/d not (d-1)/d, and they are never gathered"
        )
    fp = c.run.zero.flat
    if fp is not None:
        numel, padded = plan.numel_by_domain(), flat_numel_by_domain(fp)
        for kind in dict.fromkeys(buf.kind for buf in fp.buffers):
            bufs = [buf for buf in fp.buffers if buf.kind == kind]
            buf, size = bufs[0], padded[bufs[0].dp_axes]
            per = f" in {len(fp.groups)} groups (FSDP units and the rest)" if fp.per_unit else ""
            out.append(
                f"flat {kind} buffers: {size} elements per {' x '.join(buf.model_axes)} rank{per}, "
                f"{sum(b.n_buckets for b in bufs)} bucket(s), {size - numel[buf.dp_axes]} of them padding (64-element "
                f"param starts, bucket ends at multiples of lcm({'d' if kind == 'dense' else 'edp'}={buf.d}, 128)), "
                "which travels too"
            )
    return out
