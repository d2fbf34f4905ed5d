"""The collectives parser and the GPU targets (jzero.inspect.hlo, jzero.inspect.targets).

Run alone with: XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/inspect/test_hlo.py
"""

import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.inspect.hlo import (
    axes_of_groups,
    format_table,
    is_dp_traffic,
    parse_collectives,
    ring_wire_bytes,
    summarize,
)
from jzero.inspect.targets import TARGETS, cuda_plugin_available, gpu_mesh, parse_topology

needs_8 = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)"
)


def _fake_mesh(shape, names, ids=None):
    """What axes_of_groups reads of a Mesh (device grid + axis names), without devices."""
    ids = np.arange(np.prod(shape)) if ids is None else np.asarray(ids)
    grid = np.array([SimpleNamespace(id=int(i)) for i in ids], dtype=object).reshape(shape)
    return SimpleNamespace(devices=grid, axis_names=names)


# --------------------------------------------------------------------------- theory


def test_ring_wire_bytes():
    b = 1024
    assert ring_wire_bytes("all-reduce", b, 4) == 2 * 3 / 4 * b
    assert ring_wire_bytes("reduce-scatter", b, 4) == 3 / 4 * b
    assert ring_wire_bytes("all-gather", b, 4) == 3 / 4 * b
    assert ring_wire_bytes("all-to-all", b, 8) == 7 / 8 * b
    assert ring_wire_bytes("collective-permute", b, 2) == b
    assert ring_wire_bytes("all-reduce", b, 1) == 0
    # AllReduce = ReduceScatter + AllGather: ZeRO-1/2 move what DDP moves (docs/megatron.md, "Bytes on the wire").
    for n in (2, 4, 8, 64):
        ar = ring_wire_bytes("all-reduce", b, n)
        assert ar == ring_wire_bytes("reduce-scatter", b, n) + ring_wire_bytes("all-gather", b, n)
    with pytest.raises(ValueError):
        ring_wire_bytes("broadcast", b, 2)


def test_dp_traffic_leaves_out_the_tokens_all_to_all():
    assert is_dp_traffic("reduce-scatter", ("dp",)) and is_dp_traffic("all-gather", ("dp_outer", "dp", "ep"))
    assert not is_dp_traffic("all-to-all", ("ep",))  # a MoE's tokens to their experts: activations
    assert not is_dp_traffic("all-reduce", ("tp",)) and not is_dp_traffic("all-reduce", ("dp", "tp"))
    assert not is_dp_traffic("all-reduce", ())


# --------------------------------------------------------------------------- hand-written HLO

# GPU-style text: async pairs, a combined (tuple) all-reduce, a reduce-scatter wrapped
# in a generic async computation, iota and mesh-axes replica groups, inline operand shapes.
GPU_STYLE = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%wrapped_reduce_scatter (param_0: bf16[64,32]) -> bf16[16,32] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  ROOT %reduce-scatter.3 = bf16[16,32]{1,0} reduce-scatter(%param_0), channel_id=4, replica_groups=[2,4]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[1024], p1: bf16[256,8], p2: f32[10], p3: bf16[64,32], p4: s32[4]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = bf16[256,8]{1,0} parameter(1)
  %p2 = f32[10]{0} parameter(2)
  %p3 = bf16[64,32]{1,0} parameter(3)
  %p4 = s32[4]{0} parameter(4)
  %all-reduce-start = (f32[1024]{0}, f32[10]{0}) all-reduce-start(%p0, %p2), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %all-reduce-done = (f32[1024]{0}, f32[10]{0}) all-reduce-done(%all-reduce-start)
  %all-gather-start = ((bf16[256,8]{1,0}, s32[4]{0}), (bf16[1024,8]{1,0}, s32[16]{0})) all-gather-start(%p1, %p4), channel_id=2, replica_groups=mesh['dp'=4,'tp'=2] {'dp'}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = (bf16[1024,8]{1,0}, s32[16]{0}) all-gather-done(%all-gather-start)
  %rs-start = ((bf16[64,32]{1,0}), bf16[16,32]{1,0}) async-start(%p3), calls=%wrapped_reduce_scatter
  %rs-done = bf16[16,32]{1,0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  %cp-start = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(f32[1024]{0} %p0), channel_id=5, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  %cp-done = f32[1024]{0} collective-permute-done(%cp-start)
  %gte = f32[1024]{0} get-tuple-element(%all-reduce-done), index=0
  ROOT %out = f32[1024]{0} add(%gte, %cp-done)
}
"""


def test_parse_gpu_style_text():
    got = parse_collectives(GPU_STYLE)
    assert [c.kind for c in got] == ["reduce-scatter", "all-reduce", "all-gather", "collective-permute"]
    rs, ar, ag, cp = got

    # Counted once, in the async body; payload is the full pre-scatter input.
    assert rs.computation == "wrapped_reduce_scatter"
    assert rs.payload_bytes == 64 * 32 * 2 and rs.dtype == "bf16"
    assert rs.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and rs.group_size == 4

    # Combined all-reduce: both arrays' bytes; [4,2]<=[2,4]T(1,0) is the transposed iota.
    assert ar.payload_bytes == (1024 + 10) * 4 and ar.shapes == ((1024,), (10,))
    assert ar.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and ar.group_size == 2
    assert ar.wire_bytes == 2 * (2 - 1) / 2 * (1024 + 10) * 4

    # All-gather payload is the gathered output: operands x group size.
    assert ag.payload_bytes == (256 * 8 * 2 + 4 * 4) * 4 and ag.dtype == "bf16,s32"
    assert ag.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert ag.wire_bytes == 3 / 4 * ag.payload_bytes

    # A permute moves its operand (inline-shaped here) once; groups are the pairs.
    assert cp.payload_bytes == 4096 and cp.wire_bytes == 4096 and len(cp.replica_groups) == 8

    mesh = _fake_mesh((4, 2), ("dp", "tp"))
    assert axes_of_groups(rs.replica_groups, mesh) == ("dp", "tp")
    assert axes_of_groups(ar.replica_groups, mesh) == ("dp",)
    assert axes_of_groups(ag.replica_groups, mesh) == ("dp",)
    assert axes_of_groups(cp.replica_groups, mesh) == ("tp",)


def test_replica_group_forms():
    def groups(text):
        line = f"  %x = f32[8]{{0}} all-reduce(f32[8]{{0}} %p), {text}, to_apply=%add"
        return parse_collectives(line, num_devices=8)[0].replica_groups

    assert groups("replica_groups={}") == (tuple(range(8)),)
    assert groups("replica_groups={{0,1,2,3},{4,5,6,7}}") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert groups("replica_groups=[1,8]<=[8]") == (tuple(range(8)),)
    assert groups("replica_groups=[2,4]<=[4,2]T(1,0)") == ((0, 2, 4, 6), (1, 3, 5, 7))
    # Mesh-axes form: quoted names, several axes in listed order, sub-axes, explicit device order.
    assert groups("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}") == (
        (0, 2, 4, 6),
        (1, 3, 5, 7),
    )
    assert groups("replica_groups=mesh['a'=2,'b'=4] {'b','a'}") == ((0, 4, 1, 5, 2, 6, 3, 7),)
    assert groups("replica_groups=mesh['x'=8] {'x':(2)4}") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert groups("replica_groups=mesh['x'=8] {'x':(1)2,'x':(4)2}") == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert groups("replica_groups=mesh['a'=4,'b'=2], device_ids=(7,6,5,4,3,2,1,0) {'a'}") == (
        (7, 5, 3, 1),
        (6, 4, 2, 0),
    )
    # The short device order XLA prints for a transposed mesh: iota over [4,2], transposed.
    assert groups("replica_groups=mesh['a'=4,'b'=2], device_ids=([4,2]T(1,0)) {'a'}") == groups(
        "replica_groups=mesh['a'=4,'b'=2], device_ids=(0,2,4,6,1,3,5,7) {'a'}"
    )


def test_axes_of_groups_by_partition_or_device_id():
    mesh = _fake_mesh((2, 4, 1), ("dp_outer", "dp", "tp"))
    assert axes_of_groups([(0, 1, 2, 3), (4, 5, 6, 7)], mesh) == ("dp",)
    assert axes_of_groups([(0, 4), (1, 5)], mesh) == ("dp_outer",)
    assert axes_of_groups([tuple(range(8))], mesh) == ("dp_outer", "dp")
    assert axes_of_groups([(i,) for i in range(8)], mesh) == ()
    # A mesh over reversed devices: HLO ids are positions, device ids are looked up.
    reversed_mesh = _fake_mesh((4, 2), ("dp", "tp"), ids=range(7, -1, -1))
    assert axes_of_groups([(0, 1)], reversed_mesh) == ("tp",)
    assert axes_of_groups([(7, 5)], reversed_mesh, ids="device") == ("dp",)
    with pytest.raises(ValueError):
        axes_of_groups([(0, 8)], reversed_mesh)


def test_dtype_sizes():
    for dtype, size in {"bf16": 2, "f32": 4, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1,
                        "f64": 8, "s64": 8, "f8e4m3fn": 1}.items():  # fmt: skip
        line = f"  %x = {dtype}[3,5]{{1,0}} all-reduce({dtype}[3,5]{{1,0}} %p), replica_groups={{{{0,1}}}}"
        assert parse_collectives(line)[0].payload_bytes == 15 * size, dtype


# --------------------------------------------------------------------------- compiled on CPU


def _hand_checked_program(mesh):
    """psum_scatter over dp of a local f32[8,16], all_gather over dp of a local f32[2,16],
    psum over tp of a local bf16[4,4]."""

    def body(x, y, z):
        return (
            jax.lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True),  # [8,16] -> [2,16]
            jax.lax.all_gather(y, "dp", axis=0, tiled=True),  # [2,16] -> [8,16]
            jax.lax.psum(z, "tp"),
        )

    spec = (P("dp"), P("dp"), P("tp"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    args = (
        jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P("dp"))),
        jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("dp"))),
        jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp"))),
    )
    return f.lower(*args).compile()


def _cpu_mesh():
    return Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)


@needs_8
def test_shard_map_program_on_cpu():
    mesh = _cpu_mesh()
    got = parse_collectives(_hand_checked_program(mesh).as_text())
    by_kind = {c.kind: c for c in got}
    assert sorted(c.kind for c in got) == ["all-gather", "all-reduce", "reduce-scatter"]

    rs, ag, ar = by_kind["reduce-scatter"], by_kind["all-gather"], by_kind["all-reduce"]
    assert (rs.payload_bytes, rs.group_size, axes_of_groups(rs.replica_groups, mesh)) == (8 * 16 * 4, 4, ("dp",))
    assert (ag.payload_bytes, ag.group_size, axes_of_groups(ag.replica_groups, mesh)) == (8 * 16 * 4, 4, ("dp",))
    assert (ar.group_size, axes_of_groups(ar.replica_groups, mesh)) == (2, ("tp",))
    # XLA:CPU promotes a bf16 all-reduce to f32 (seen: `%region_1.0_promoted`); on GPU it
    # stays bf16 (see the H100 test). Either way the payload is 16 elements of its dtype.
    assert ar.dtype in ("bf16", "f32")
    assert ar.payload_bytes == 16 * {"bf16": 2, "f32": 4}[ar.dtype]
    assert rs.wire_bytes == 3 / 4 * 512 and ag.wire_bytes == 3 / 4 * 512

    rows = summarize(got, mesh)
    assert [(r["kind"], r["axes"], r["count"]) for r in rows] == [
        ("all-reduce", ("tp",), 1),
        ("reduce-scatter", ("dp",), 1),
        ("all-gather", ("dp",), 1),
    ]
    table = format_table({"hand-checked": rows})
    assert "hand-checked" in table and "reduce-scatter" in table


@needs_8
def test_cpu_sharding_spec_reduces_with_all_reduce():
    """docs/xla.md, "Reduce-scatter: XLA:CPU vs XLA:GPU": XLA:CPU lowers a dp-sharded sum to all-reduce (+ slice), not reduce-scatter."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    s = NamedSharding(mesh, P("dp"))
    compiled = jax.jit(lambda x: x.sum(0), in_shardings=s, out_shardings=s).lower(
        jax.ShapeDtypeStruct((32, 16), jnp.float32)
    )
    got = parse_collectives(compiled.compile().as_text())
    assert [(c.kind, axes_of_groups(c.replica_groups, mesh), c.payload_bytes) for c in got] == [
        ("all-reduce", ("dp",), 16 * 4)
    ]


# --------------------------------------------------------------------------- GPU targets


def test_targets_and_topology_text():
    assert set(TARGETS) == {"h100", "a100", "h200"}
    assert 80e9 <= TARGETS["h100"].memory_bytes < 86e9 and 80e9 <= TARGETS["a100"].memory_bytes < 86e9
    assert 141e9 <= TARGETS["h200"].memory_bytes < 152e9
    assert "device_memory_size" in TARGETS["h100"].config_text()
    assert parse_topology("4 x 1 x 8") == (4, 1, 8) and parse_topology("2x2x8") == (2, 2, 8)
    for bad in ("4 x 8", "4 x 0 x 8", "a x 1 x 8", ""):
        with pytest.raises(ValueError, match="slices x hosts_per_slice x gpus_per_host"):
            parse_topology(bad)
    with pytest.raises(ValueError, match="does not fit"):
        gpu_mesh("h100", "1 x 1 x 8", (4, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match="unknown GPU target"):
        gpu_mesh("v100", "1 x 1 x 8", (4, 2), ("dp", "tp"))


def test_missing_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)  # makes the import fail
    assert not cuda_plugin_available()
    with pytest.raises(RuntimeError, match=r"pip install -e \.\[gpu-aot\].*jax-cuda12-plugin==.*jax-cuda12-pjrt=="):
        gpu_mesh("h100", "1 x 1 x 8", (4, 2), ("dp", "tp"))


@pytest.mark.skipif(not cuda_plugin_available(), reason="CUDA PJRT plugin not installed: pip install -e .[gpu-aot]")
def test_deviceless_h100_compiles_reduce_scatter():
    """docs/xla.md, "Reduce-scatter: XLA:CPU vs XLA:GPU": on GPU the same dp-sharded sum is a real reduce-scatter, and bf16 stays bf16."""
    mesh = gpu_mesh("h100", "1 x 1 x 8", (4, 2), ("dp", "tp"))
    assert len(mesh.devices.flat) == 8 and mesh.devices.flat[0].device_kind == TARGETS["h100"].device_kind
    s = NamedSharding(mesh, P("dp"))
    compiled = jax.jit(lambda x: x.sum(0), in_shardings=s, out_shardings=s).lower(
        jax.ShapeDtypeStruct((32, 16), jnp.float32)
    )
    got = parse_collectives(compiled.compile().as_text())
    # Each device holds f32[8,16], sums it to a partial f32[16] and reduce-scatters that.
    assert [(c.kind, axes_of_groups(c.replica_groups, mesh), c.payload_bytes) for c in got] == [
        ("reduce-scatter", ("dp",), 16 * 4)
    ]

    got = parse_collectives(_hand_checked_program(mesh).as_text())
    ar = next(c for c in got if c.kind == "all-reduce")
    assert (ar.dtype, ar.payload_bytes, axes_of_groups(ar.replica_groups, mesh)) == ("bf16", 32, ("tp",))
    assert sorted(c.kind for c in got) == ["all-gather", "all-reduce", "reduce-scatter"]
