"""XLA options for a ZeRO step: what makes XLA:GPU overlap the DP collectives inside the layer loop.

A scanned stack of layers is one `while` loop, and XLA:GPU's latency-hiding scheduler overlaps a
collective only with work of the same loop iteration: the first gathers of a layer and the last
reduce-scatters of its backward find nothing of their own layer to hide behind. XLA's collective
pipeliner moves them into the neighbouring iteration: the next layer's all-gathers start while this
layer computes (`xla_gpu_enable_pipelined_all_gather`), a layer's reduce-scatter or all-reduce
finishes while the next layer's backward runs (`..._reduce_scatter`, `..._all_reduce`), and the
loop body is unrolled twice so both iterations' buffers exist (`xla_gpu_enable_while_loop_double_
buffering`). MaxText turns on the same options for FSDP on GPUs. Measured on LLaMA-2-7B's ZeRO-2
step on 8 x H100 (deviceless): exposed DP wire 5.15 -> 1.92 GiB of 32.95 GiB, temp peak 21.13 ->
20.34 GiB (docs/overlap.md). With several micro-batches the double buffering costs more than it
gives (it unrolls the micro-batch loop too): at 8 micro-batches, without it, ZeRO-1 leaves 1.76
instead of 5.18 GiB exposed and peaks at 70.8 instead of 82.4 GiB, ZeRO-2 10.4 instead of 18.1 GiB
and 33.5 instead of 36.2 GiB; so it is on for one micro-batch only.

The spec path reduces and gathers each param by its own collective, and XLA:GPU runs one collective
of a kind at a time, so a layer's queue behind each other and the one the step waits for may be
left exposed. On the spec path the combiner's threshold of the kind that queues is raised
(`COMBINE`): the backward's reduce-scatters under ZeRO-1/2 to 1 GiB, so a layer's become one, as
the flat path's one bucket per unit is, and the gathers under ZeRO-3 to 256 MiB, a few per layer
(LLaMA-2-7B on 8 x H100, exposed DP wire at one micro-batch: ZeRO-1/2 5.8% -> 3.7%, ZeRO-3 8.8% ->
3.4%, at 8 micro-batches 4.0%; docs/overlap.md). 256 MiB is the threshold that holds on jaxlib
0.10.2 and 0.11.2 alike (3.4% at one micro-batch on both; exposed time 12.9 and 14.2 ms of 104):
128 MiB left 3.0% on 0.10.2 but 9.1% on 0.11.2, whose combiner then splits a layer's backward
gathers so that its QKV gather finds no matmul beside it; 512 MiB and 1 GiB left 4.1% and 5.0% on
0.10.2 (a layer's first matmul waits for a larger gather). Combining the other kind too measured worse
(ZeRO-3's reduce-scatters as well, at 1 GiB: 6.3%; ZeRO-1/2's gathers are the forward's, already
overlapped: 7.1%). DDP's all-reduces are combined up to 1 GiB, a layer's in one: XLA peels the
backward's first layer out of the loop and leaves the last one's pipelined all-reduces after it, and
those layers' per-param all-reduces found no matmul beside them (LLaMA-2-7B cut to 8 layers on 8 x
H100, exposed DP wire 29.5% -> 13.9% at one micro-batch and 19.9% -> 13.9% at 8, the flat path's;
`jzero hlo`'s exposed time 13.6 -> 11.5 ms at one, 10.7 -> 13.5 ms at 8; temp 8.86 -> 9.58 GiB at
one, a layer's fp32 grads in one buffer, 19.56 -> 19.67 GiB at 8; 512 MiB changed nothing).
ZeRO-3's backward gathers reach the pipeliner only when the unit's recompute carries no
optimization barrier (`units.unit(..., prevent_cse=False)` in a scan body); its micro-batch loop is
kept whole by one (`schedule._accumulate`).

Under HSDP (`mesh.dp_outer > 1`) the grads are all-reduced across dp_outer alone, between hosts,
after the reduce-scatter inside (`zero.outer_strategy: no_shard`; the spec path's DDP too, whose
chain of three, reduce-scatter inside, all-reduce across, all-gather inside, is
`units.Hook.regather`). XLA's pipeliner moving that all-reduce into the next layer's iteration left
more of the step waiting on the network, not less, so under HSDP the all-reduces are not pipelined
and the loop is not double buffered; on the spec path, where each grad has collectives of its own,
the all-reduces are combined up to 1 GiB (`COMBINE["all_reduces"]`; DDP's reduce-scatters and
all-gathers too, `COMBINE["hierarchical"]`), at about the same temp peak. LLaMA-2-7B on 2 hosts x 8
H100s, dp_outer 2 x dp 8, `jzero hlo`'s exposed comm per step, with one host's options -> neither
pipelined all-reduces nor double buffering -> the all-reduces combined too: ZeRO-1/2 56 -> 15.5 ->
9.0 ms, ZeRO-3 87 -> 25.4 -> 23.8 ms; at 8 micro-batches ZeRO-1 58 -> 15 -> 8, ZeRO-2 442 -> 87 ->
43.5, ZeRO-3 774 -> 182 -> 169 ms. DDP on the 7B cut to 8 layers (the 32-layer model does not fit
under DDP): 32.4 ms with one host's options, 22.2 with its three collectives combined, 15.3 now.
Under `outer_strategy: optim` (reduce-scatters across dp_outer) the pipelining changes little
(ZeRO-2 32.8 -> 33.5, ZeRO-3 35.0 -> 32.3 ms); those figures are of 2026-11-27. ZeRO-3 under HSDP whose
dp_outer spans hosts also lets XLA keep two collectives in flight (`TWO_IN_FLIGHT`, where the running XLA
knows the option; else it compiles without, as before), the all-reduce between the hosts
beside the gathers and reduce-scatters inside: one at a time, the layer loop's queued behind each
other (2026-11-28: spec 38 -> 18 ms exposed at one micro-batch, flat 36 -> 10, at 8 micro-batches
286 -> 109 and 273 -> 66; `outer_strategy: optim` 42 -> 41). ZeRO-2 under HSDP (spec 8.6 -> 20.4 ms)
and ZeRO-3 on one host (spec 10.0 -> 34.6, where both would share NVLink; flat 16.5 -> 11.7 at one
micro-batch but 45.6 -> 112 at 8) measured worse with it. Without HSDP, ZeRO-1/2/3 keep two in flight
where the DP collectives cross hosts while tp's or ep's stay inside one, the network's link and NVLink
busy at once (2026-11-28, `jzero hlo`'s exposed comm per step on 64 H100s, 8 hosts: LLaMA-2-70B, dp 8
between hosts x tp 8 inside, spec ZeRO-1/2 880 -> 749 ms and ZeRO-3 1170 -> 1010 at one micro-batch,
ZeRO-2 4830 -> 3800 and ZeRO-3 9430 -> 8680 at 8, ZeRO-1 951 -> 954 there; flat ZeRO-1/2 881 -> 678;
Mixtral-8x7B, dp 8 x ep 8 inside, spec ZeRO-1/2 653 -> 364 and ZeRO-3 896 -> 633, at 8 micro-batches
658 -> 368, 3440 -> 1780 and 7190 -> 5970, flat ZeRO-1/2 649 -> 362; temp peaks +0.4 to +1.9 GiB;
DDP's all-reduces unchanged, so left as they were). Pipelined all-reduces stay where they span
the whole DP domain: DDP on one host (the 8-layer 7B on 8 H100s, a layer's all-reduces combined: 11.5 ms
exposed, 29.3 without, all of it) and the flat path's DDP under HSDP, Megatron's one all-reduce per
bucket (244 ms with, 282 without).
experiments/collectives/README.md, "HSDP", has the tables.

They are set only for GPU meshes (the CPU program stays as it was) and only with
`zero.overlap_grad_reduce`, through `jax.jit(compiler_options=...)`, so a user's XLA_FLAGS
stay theirs. XLA renamed the pipeliner's options (openxla/xla#45836): jaxlib 0.10.2 knows the
booleans `xla_gpu_enable_pipelined_<collective>`, 0.11.2 only the modes `xla_gpu_pipeline_<collective>`
(`COLLECTIVE_PIPELINING_MODE_ON` is the old `true`) and refuses a step compiled with the old names
("No such compile option"). `pipeline_options` asks the running XLA which names it takes, once per
device, by compiling a one-scalar program with each (docs/xla.md, "Supported JAX versions").
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, SingleDeviceSharding

from jzero.mesh import DP_AXIS, EP_AXIS, OUTER_AXIS, TP_AXIS
from jzero.zero.config import ZeroConfig, ZeroPath

_PIPELINED = ("all_gather", "reduce_scatter", "all_reduce")
# The pipeliner's options as XLA has spelled them, newest first.
PIPELINER_SPELLINGS = (
    {f"xla_gpu_pipeline_{c}": "COLLECTIVE_PIPELINING_MODE_ON" for c in _PIPELINED},  # jaxlib 0.11.2
    {f"xla_gpu_enable_pipelined_{c}": True for c in _PIPELINED},  # jaxlib 0.10.2
)
# The spec path: a layer's collectives of the kind that queues combined (module docstring). A LLaMA-2-7B,
# 70B or 405B layer's params (bf16, tp-local) are 0.4, 0.2 and 0.8 GB, fp32 grads twice that.
COMBINE = {
    "gathers": {"xla_gpu_all_gather_combine_threshold_bytes": 1 << 28},  # ZeRO-3
    "reductions": {"xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 30},  # ZeRO-1/2
    "all_reduces": {"xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30},  # DDP; HSDP: those across dp_outer
}
# Two collectives in flight at once where the step keeps two links busy (`_two_links`; module docstring).
TWO_IN_FLIGHT = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
COMBINE["hierarchical"] = {  # DDP under HSDP: its reduce-scatter, all-reduce and all-gather per grad
    **COMBINE["reductions"], **COMBINE["all_reduces"], "xla_gpu_all_gather_combine_threshold_bytes": 1 << 30
}


@functools.cache
def pipeline_options(device: jax.Device) -> dict:
    """The collective pipeliner's options in the spelling the XLA of `device` takes (module docstring);
    {} with a warning where it takes none of them (the step then compiles without the pipeliner)."""
    for options in PIPELINER_SPELLINGS:
        if _takes(device, tuple(options.items())):
            return options
    warnings.warn(
        f"jzero: this XLA ({device.client.platform_version}) knows none of the collective pipeliner's options "
        f"{[sorted(o) for o in PIPELINER_SPELLINGS]}; ZeRO steps compile without it and overlap less "
        "(jzero/zero/common/compiler.py)",
        stacklevel=2,
    )
    return {}


@functools.cache
def _takes(device: jax.Device, options: tuple) -> bool:
    """Whether the XLA of `device` knows the compile options `options` ((name, value) pairs), asked by
    compiling a one-scalar program with them."""
    probe = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32, sharding=SingleDeviceSharding(device)))
    try:
        probe.compile(compiler_options=dict(options))
        return True
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" not in str(e):
            raise
        return False


def _spans_hosts(mesh: Mesh, axis: str) -> bool:
    """Whether a group along `axis` (the other axes fixed) holds devices of more than one process (host)."""
    if axis not in mesh.shape:
        return False
    index = tuple(slice(None) if name == axis else 0 for name in mesh.axis_names)
    return len({d.process_index for d in mesh.devices[index].flat}) > 1


def _two_links(mesh: Mesh, stage) -> bool:
    """Whether the step's collectives keep two links busy, so that XLA may keep two in flight (`TWO_IN_FLIGHT`,
    module docstring): under HSDP ZeRO-3's all-reduce across dp_outer between hosts beside its gathers and
    reduce-scatters inside; without it, ZeRO-1/2/3's DP collectives between hosts beside the tp or ep
    collectives inside one."""
    if mesh.shape.get(OUTER_AXIS, 1) > 1:
        return stage.shards_params and _spans_hosts(mesh, OUTER_AXIS)
    inside = any(mesh.shape.get(a, 1) > 1 and not _spans_hosts(mesh, a) for a in (TP_AXIS, EP_AXIS))
    return stage.shards_state and inside and _spans_hosts(mesh, DP_AXIS)


def step_compiler_options(mesh: Mesh, config: ZeroConfig, microbatches: int) -> dict:
    """The XLA options of a ZeRO step on `mesh` (module docstring); {} off a GPU or without overlap."""
    device = mesh.devices.flat[0]
    if device.platform not in ("gpu", "cuda", "rocm") or not config.overlap_grad_reduce:
        return {}
    hsdp, stage = mesh.shape.get(OUTER_AXIS, 1) > 1, config.stage
    # the grads are all-reduced across dp_outer alone, a hierarchy's last step: not pipelined (docstring)
    across = hsdp and (config.path == ZeroPath.SPEC or stage.shards_state)
    pipeline = {k: v for k, v in pipeline_options(device).items() if not (across and k.endswith("all_reduce"))}
    options = {**pipeline, "xla_gpu_enable_while_loop_double_buffering": microbatches == 1 and not across}
    if config.path == ZeroPath.SPEC and stage.shards_state:
        combine = COMBINE["gathers" if stage.shards_params else "reductions"]
        options |= combine | (COMBINE["all_reduces"] if hsdp else {})
    elif config.path == ZeroPath.SPEC:  # DDP
        options |= COMBINE["hierarchical" if hsdp else "all_reduces"]
    if _two_links(mesh, stage) and _takes(device, tuple(TWO_IN_FLIGHT.items())):
        options |= TWO_IN_FLIGHT
    return options
