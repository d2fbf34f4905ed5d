"""What XLA scheduled around each collective, and the flops in its window (jzero.inspect.overlap).

Every fixture is a real program compiled here: on the 8 simulated CPU devices, and, where the
CUDA plugin is installed, deviceless for 8 H100s (docs/xla.md, "Deviceless GPU compilation").
"""

import re

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from jax.sharding import PartitionSpec as P

from helpers import tiny_config
from helpers.programs import D, cpu_mesh, h100_mesh, needs_gpu_plugin, sds
from jzero.inspect import hlo, overlap
from jzero.inspect.compile import compile_step, compile_with_dump


def _gather_beside_matmul(mesh, dependent: bool):
    """All-gather x over dp; a [D, D] x [D, D] matmul that reads the gathered x, or does not."""

    def body(x, y, z):
        g = jax.lax.all_gather(x, "dp", axis=0, tiled=True)  # [D, D]
        if dependent:
            return (g @ z).sum().reshape(1)
        return (g.sum() + (y @ z).sum()).reshape(1)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P("dp")))
    return f.lower(sds((D, D), mesh, P("dp")), sds((D, D), mesh, P()), sds((D, D), mesh, P()))


def _reduce_scatter_beside_matmul(mesh):
    """Reduce-scatter x over dp beside an independent [D, D] x [D, D] matmul (async on every XLA:GPU
    here; a lone reduce-scatter jaxlib 0.11.2 leaves synchronous)."""

    def body(x, y, z):
        return jax.lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True).sum().reshape(1) + (y @ z).sum()

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P("dp")))
    return f.lower(*(sds((D, D), mesh, P()) for _ in range(3)))


def _scan_with_collective(mesh, steps=4):
    """A scan whose body reduce-scatters its weight and, independently, multiplies by it."""

    def body(ws, x):
        def step(h, w):
            shard = jax.lax.psum_scatter(jax.lax.pcast(w, "dp", to="varying"), "dp", scatter_dimension=0, tiled=True)
            return jnp.tanh(h @ w), shard

        return jax.lax.scan(step, x, ws)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P("dp"), P(None, "dp"))))
    return f.lower(sds((steps, D, D), mesh, P()), sds((64, D), mesh, P("dp")))


# --------------------------------------------------------------------------- flops


def test_flops_count_dots_in_loops_and_convolutions():
    def scan(w, x):  # 5 x [32, 64] @ [64, 64]
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    text = jax.jit(scan).lower(jax.ShapeDtypeStruct((5, 64, 64), jnp.float32), jnp.ones((32, 64))).compile().as_text()
    s = overlap.read_schedule(text)
    assert s.scheduled and s.unknown_trip_counts == 0
    assert s.step_flops == 5 * 2 * 32 * 64 * 64 and s.overlaps == ()

    def conv(x, k):  # NHWC [2, 16, 16, 8] * HWIO [3, 3, 8, 4], SAME
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    text = jax.jit(conv).lower(jnp.ones((2, 16, 16, 8)), jnp.ones((3, 3, 8, 4))).compile().as_text()
    assert overlap.read_schedule(text).step_flops == 2 * (2 * 16 * 16 * 4) * (3 * 3 * 8)


def test_a_loop_xla_gave_no_trip_count_is_counted_from_its_condition():
    """XLA drops `known_trip_count` from a loop it peels (ZeRO-3's micro-batch loop on H100): the count
    is then read from the loop itself, `i < N` from a constant start."""

    def scan(w, x):  # 5 x [32, 64] @ [64, 64]
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    text = jax.jit(scan).lower(jax.ShapeDtypeStruct((5, 64, 64), jnp.float32), jnp.ones((32, 64))).compile().as_text()
    stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
    assert stripped != text
    s = overlap.read_schedule(stripped)
    assert s.unknown_trip_counts == 0 and s.step_flops == 5 * 2 * 32 * 64 * 64
    # A condition it cannot read (here `i != N`) is counted once, and said.
    assert overlap.read_schedule(stripped.replace("direction=LT", "direction=NE")).unknown_trip_counts == 1


def test_cublas_gemm_counts_like_a_dot():
    # XLA:GPU's printed form of a GEMM it hands to cuBLAS (deviceless compiles pick Triton fusions).
    text = """HloModule m, is_scheduled=true

ENTRY %e (p0: f32[64,32], p1: f32[32,16]) -> f32[64,16] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  %gemm = (f32[64,16]{1,0}, s8[4096]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm", \
backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":\
{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],\
"rhs_batch_dimensions":[]}}}
  ROOT %out = f32[64,16]{1,0} get-tuple-element(%gemm), index=0
}
"""
    assert overlap.read_schedule(text).step_flops == 2 * 64 * 16 * 32


@pytest.mark.parametrize("mask, half", [("CAUSAL", 0.5), ("NO_MASK", 1.0)])
def test_cudnn_attention_counts_its_matmuls(mask, half):
    """cuDNN's fused attention (XLA:GPU's form for `model.attention: cudnn`): 2 batched matmuls forward and 5
    backward (the flash kernel computes the scores again), each 2 x [B, H, T, T] x the head dim; half under a
    causal mask."""
    config = ('backend_config={"operation_queue_id":"0","cudnn_fmha_backend_config":{"fmha_scale":0.25,'
              '"intermediate_tensor_shape":{"element_type":"BF16","dimensions":["1","2","64","64"],'
              f'"tuple_shapes":[]}},"is_flash_attention":true,"mask_type":"{mask}"}}}}')  # fmt: skip
    q = "bf16[1,64,2,16]{3,2,1,0}"  # [B, T, H, K]
    text = f"""HloModule m, is_scheduled=true

ENTRY %e (q: bf16[1,64,2,16], s: f32[1,2,64]) -> bf16[1,64,2,16] {{
  %q = {q} parameter(0)
  %s = f32[1,2,64]{{2,1,0}} parameter(1)
  %fwd = ({q}, f32[1,2,64]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", \
{config}
  %o = {q} get-tuple-element(%fwd), index=0
  %bwd = ({q}, {q}, {q}, u8[0]{{0}}) custom-call(%q, %q, %q, %s, %o, %o), \
custom_call_target="__cudnn$fmhaSoftmaxBackward", {config}
  ROOT %dq = {q} get-tuple-element(%bwd), index=0
}}
"""
    scores_by_head_dim = 2 * 64 * 64 * 16
    assert overlap.read_schedule(text).step_flops == (2 + 5) * 2 * scores_by_head_dim * half


# --------------------------------------------------------------------------- overlap


def test_cpu_collectives_are_synchronous_and_exposed():
    s = overlap.read_schedule(_gather_beside_matmul(cpu_mesh(), dependent=False).compile().as_text())
    (ag,) = s.overlaps
    assert ag.collective.kind == "all-gather" and not ag.is_async and ag.exposed
    assert ag.window_flops == 0 and ag.window_instructions == 0
    assert s.step_flops == 2 * D**3  # the matmul is counted, just not inside a window


def test_cpu_collective_in_a_loop_runs_once_per_iteration():
    s = overlap.read_schedule(_scan_with_collective(cpu_mesh()).compile().as_text())
    (rs,) = s.overlaps
    assert rs.collective.kind == "reduce-scatter" and rs.runs == 4 and rs.computation != s.entry
    assert s.step_flops == 4 * 2 * 8 * D * D  # [8, D] @ [D, D] per rank, 4 times


@needs_gpu_plugin
def test_h100_all_gather_overlaps_an_independent_matmul():
    s = overlap.read_schedule(_gather_beside_matmul(h100_mesh(), dependent=False).compile().as_text())
    (ag,) = s.overlaps
    assert ag.is_async and not ag.exposed
    assert ag.window_flops == 2 * D**3 == s.step_flops  # the whole matmul runs while it gathers


@needs_gpu_plugin
def test_h100_all_gather_feeding_the_matmul_overlaps_nothing():
    s = overlap.read_schedule(_gather_beside_matmul(h100_mesh(), dependent=True).compile().as_text())
    (ag,) = s.overlaps
    assert ag.exposed and ag.window_flops == 0 and s.step_flops == 2 * D**3


@needs_gpu_plugin
def test_h100_collective_in_a_loop_body_overlaps_within_the_body():
    s = overlap.read_schedule(_scan_with_collective(h100_mesh()).compile().as_text())
    in_loop = [o for o in s.overlaps if o.computation != s.entry]
    body_matmul = 2 * 8 * D * D
    # jaxlib 0.10 runs the body's matmul inside the reduce-scatter's window; 0.11.2 schedules the
    # reduce-scatter's done before it (read in its HLO), so its window holds no matmul.
    windows = {body_matmul} if jaxlib.__version__.startswith("0.10.") else {0, body_matmul}
    assert in_loop and all(o.is_async and o.window_flops in windows for o in in_loop)
    # XLA may peel iterations out of the loop; every iteration's collective is still counted once.
    assert sum(o.runs for o in s.overlaps) == 4 and s.step_flops == 4 * 2 * 8 * D * D


@needs_gpu_plugin
def test_h100_reduce_scatter_reads_the_same_in_both_printed_forms():
    lowered = _reduce_scatter_beside_matmul(h100_mesh())
    compiled, dump = compile_with_dump(lowered)
    sugared = compiled.as_text()  # `reduce-scatter-start` / `reduce-scatter-done`
    generic = dump.hlo  # `async-start`, calls=%async_computation
    assert "reduce-scatter-start(" in sugared and "async-start(" in generic

    def key(s):
        return [(o.collective.kind, o.collective.payload_bytes, o.is_async, o.window_flops) for o in s.overlaps]

    assert key(overlap.read_schedule(sugared)) == key(overlap.read_schedule(generic))
    assert [o.collective.kind for o in overlap.read_schedule(sugared).overlaps] == ["reduce-scatter"]


# --------------------------------------------------------------------------- a compiled step


def test_zero2_step_reports_schedule_on_cpu():
    c = compile_step(tiny_config("optim_grads", microbatches=2, zero={"overlap_grad_reduce": False}), dump=False)
    sch = overlap.schedule_report(c)
    assert sch["scheduled"] and sch["step_flops"] > 0
    dp = [r for r in sch["collectives"] if r["axes"] == ["dp"]]
    assert dp and all(not r["async"] and r["exposed"] for r in dp)  # XLA:CPU: every collective is synchronous
    dp_wire = sum(r["wire_bytes"] for r in hlo.summarize(hlo.parse_collectives(c.compiled.as_text()), c.run.mesh)
                  if r["axes"] == ("dp",))  # fmt: skip
    assert sch["exposed_dp_wire_bytes"] == pytest.approx(dp_wire)
    assert any(r["runs"] == 2 for r in dp)  # ZeRO-2 reduces in the micro-batch loop
    lines = overlap.format_lines({"schedule": sch, "dp_wire_bytes": dp_wire})
    assert any(line.startswith("  exposed DP wire/device") for line in lines)
