"""The time estimate of `jzero hlo` (jzero.inspect.timing): DP collectives' wire bytes over the links
their groups cross, less the compute in their windows, beside the step's flops at peak. Programs compiled deviceless for
H100 hosts of 4 GPUs, so that a group along one mesh axis stays in a host and along the other
spans two."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from helpers.programs import D, cpu_mesh, needs_gpu_plugin, sds
from jzero.cli import main
from jzero.inspect import overlap, timing
from jzero.inspect.targets import gpu_mesh


def _gather_then_matmul(mesh):
    """All-gather x [D, D] over dp, then a matmul that reads it: the gather has nothing to hide behind."""

    def body(x, z):
        return (jax.lax.all_gather(x, "dp", axis=0, tiled=True) @ z).sum().reshape(1, 1)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp", "tp")))
    return overlap.read_schedule(f.lower(sds((D, D), mesh, P("dp")), sds((D, D), mesh, P())).compile().as_text())


@needs_gpu_plugin
@pytest.mark.parametrize("across", [False, True])
def test_exposed_gather_costs_its_wire_bytes_over_the_link_it_crosses(across):
    # "1 x 2 x 4": devices 0-3 on host 0, 4-7 on host 1; mesh dims take them in order.
    shape, axes = ((2, 4), ("dp", "tp")) if across else ((4, 2), ("tp", "dp"))
    mesh = gpu_mesh("h100", "1 x 2 x 4", shape, axes)
    sch = _gather_then_matmul(mesh)
    (ag,) = sch.overlaps
    assert ag.exposed
    links = timing.Links(nvlink=400e9, network=40e9, peak_flops=1e15)
    t = timing.estimate(sch, mesh, links)
    seconds = ag.collective.wire_bytes / (links.network if across else links.nvlink)
    assert t.exposed_s == pytest.approx(seconds) and t.wire_s == pytest.approx(seconds)
    assert t.network_share == (1.0 if across else 0.0)
    assert t.compute_s == pytest.approx(sch.step_flops / 1e15) and sch.step_flops == 2 * D**3


def _gather_beside_a_matmul(mesh):
    """All-gather x [D, D] over dp while an independent matmul y @ y runs; then a matmul reads it."""

    def body(x, y, z):
        return ((jax.lax.all_gather(x, "dp", axis=0, tiled=True) @ z).sum() + (y @ y).sum()).reshape(1, 1)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P("dp", "tp")))
    args = sds((D, D), mesh, P("dp")), sds((D, D), mesh, P()), sds((D, D), mesh, P())
    return overlap.read_schedule(f.lower(*args).compile().as_text())


@needs_gpu_plugin
@pytest.mark.parametrize("gbs", [1e-3, 1e6])
def test_an_overlapped_collective_is_exposed_only_beyond_its_windows_compute(gbs):
    """On a slow enough link a gather outlasts the matmul beside it: the excess is exposed; on a fast
    one, nothing."""
    mesh = gpu_mesh("h100", "1 x 2 x 4", (4, 2), ("tp", "dp"))
    sch = _gather_beside_a_matmul(mesh)
    (ag,) = sch.overlaps
    assert not ag.exposed and ag.window_flops == 2 * D**3
    links = timing.Links(nvlink=gbs * 1e9, network=gbs * 1e9, peak_flops=1e15)
    t = timing.estimate(sch, mesh, links)
    assert t.exposed_s == pytest.approx(max(0.0, t.wire_s - ag.window_flops / 1e15))
    assert (t.exposed_s > 0) == (gbs < 1)


@needs_gpu_plugin
def test_report_takes_the_targets_links_and_the_overrides():
    mesh = gpu_mesh("h100", "1 x 2 x 4", (2, 4), ("dp", "tp"))
    sch = _gather_then_matmul(mesh)
    default = timing.timing_report("h100", sch, mesh)
    assert (default["nvlink_gbs"], default["network_gbs"], default["peak_tflops"]) == (450, 50, 989)
    halved = timing.timing_report("h100", sch, mesh, timing.Overrides(network_gbs=25, peak_tflops=100))
    assert halved["exposed_s"] == pytest.approx(2 * default["exposed_s"])
    assert halved["compute_s"] == pytest.approx(9.89 * default["compute_s"])
    assert halved["line"].startswith("exposed comm ~ ") and " of compute per step" in halved["line"]


def test_no_estimate_for_cpu_devices():
    mesh = cpu_mesh()
    f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P()))
    sch = overlap.read_schedule(f.lower(sds((8, D), mesh, P("dp"))).compile().as_text())
    assert timing.timing_report("cpu", sch, mesh) is None


@pytest.mark.parametrize("value", ["0", "-5", "fast", "inf"])
def test_link_flags_refuse_what_is_not_a_positive_number(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["hlo", "--target", "h100", "--network-gbs", value])
    assert e.value.code == 2 and "--network-gbs" in capsys.readouterr().err


def _played(order: str, across: str = "") -> float:
    """`timing._stalls` of a schedule spelled one character per instruction: a letter starts that
    collective (1 s alone on its link), its capital is its done (none: done in the next iteration, as a
    pipelined one's), `m` a matmul of 1 s; `across` names the collectives on the network (the rest share
    NVLink)."""
    prefix, starts, ends = [0.0], {}, {}
    for n, c in enumerate(order):
        prefix.append(prefix[-1] + (1.0 if c == "m" else 0.0))
        if c.islower() and c != "m":
            starts[c] = n
        elif c.isupper():
            ends[c.lower()] = n
    ons = [timing._OnWire(n, ends.get(c, len(order)), c in across, 1.0, 0.0) for c, n in starts.items()]
    return timing._stalls(ons, tuple(prefix), peak=1.0)


def test_collectives_in_flight_together_share_their_link():
    """Two 1 s collectives started before one 1 s matmul: on one link they take 2 s and the step waits
    1 s; on NVLink and the network each has the matmul to itself. One after the other, each has its own
    window's compute, as a single collective is exposed beyond its window's compute."""
    assert _played("abmAB") == pytest.approx(1.0)
    assert _played("abmBA") == pytest.approx(1.0)
    assert _played("abmAB", across="b") == pytest.approx(0.0)
    assert _played("amAbmB") == pytest.approx(0.0)
    assert _played("aAmbmmB") == pytest.approx(1.0)  # a waited for alone; b hidden
    assert _played("abAmB") == pytest.approx(2.0)  # a waits at half rate, b done with it
    assert _played("aA") == _played("aA", across="a") == pytest.approx(1.0)  # synchronous
    assert _played("am") == pytest.approx(0.0)  # pipelined: the rest of the iteration overlaps it
    assert _played("abm") == pytest.approx(1.0)
    alone = [timing._OnWire(0, 3, False, 1.0, 0.5), timing._OnWire(4, 6, False, 1.0, 2.0)]
    assert timing._stalls(alone, None, peak=1.0) == pytest.approx(0.5)  # no flops per position: each by its window
