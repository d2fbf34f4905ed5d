"""The XLA options of a ZeRO step (`jzero/zero/common/compiler.py`): XLA:GPU's collective pipeliner
with overlap on a GPU mesh (and the spec path's raised combiner thresholds), nothing on a CPU mesh or
without overlap."""

import numpy as np
import pytest
from jax.sharding import Mesh

from helpers.programs import needs_gpu_plugin
from jzero.inspect.targets import gpu_mesh
from jzero.zero.common.compiler import COMBINE, PIPELINER_SPELLINGS, pipeline_options, step_compiler_options
from jzero.zero.config import ZeroConfig


@needs_gpu_plugin
def test_the_pipeliner_options_are_the_ones_this_xla_takes():
    """XLA renamed them between jaxlib 0.10.2 and 0.11.2; the step's options compile a program on this XLA."""
    import jax
    import jax.numpy as jnp

    mesh = gpu_mesh("h100", "1 x 1 x 8", (8,), ("dp",))
    options = step_compiler_options(mesh, ZeroConfig(), 1)
    assert any(set(spelling) <= set(options) for spelling in PIPELINER_SPELLINGS), options
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding))
    lowered.compile(compiler_options=options)


@needs_gpu_plugin
def test_an_xla_that_knows_no_pipeliner_option_compiles_without_it_and_says_so(monkeypatch):
    from jzero.zero.common import compiler

    device = gpu_mesh("h100", "1 x 1 x 8", (8,), ("dp",)).devices.flat[0]
    monkeypatch.setattr(compiler, "PIPELINER_SPELLINGS", ({"xla_gpu_no_such_pipeliner_option": True},))
    compiler.pipeline_options.cache_clear()
    try:
        with pytest.warns(UserWarning, match="knows none of the collective pipeliner's options"):
            assert compiler.pipeline_options(device) == {}
    finally:
        compiler.pipeline_options.cache_clear()


def cpu_mesh():
    import jax

    return Mesh(np.asarray(jax.devices()[:8]), ("dp",))


def test_no_options_on_cpu():
    assert step_compiler_options(cpu_mesh(), ZeroConfig(), 1) == {}


@needs_gpu_plugin
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("microbatches", [1, 8])
def test_gpu_mesh_pipelines_collectives_with_overlap(overlap, microbatches):
    """With overlap, the pipeliner (and, ZeRO-2 on the spec path, its reductions combined); the loop's
    double buffering for one micro-batch only."""
    mesh = gpu_mesh("h100", "1 x 1 x 8", (8,), ("dp",))
    options = step_compiler_options(mesh, ZeroConfig(overlap_grad_reduce=overlap), microbatches)
    double = {"xla_gpu_enable_while_loop_double_buffering": microbatches == 1}
    pipeline = pipeline_options(mesh.devices.flat[0])
    assert options == ({**pipeline, **double, **COMBINE["reductions"]} if overlap else {})


@needs_gpu_plugin
@pytest.mark.parametrize("path", ["spec", "flat"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_the_spec_path_combines_a_layers_collectives(strategy, path):
    """The spec path raises the combiner of the kind that queues: all-reduces under DDP, reductions under
    ZeRO-1/2, gathers under ZeRO-3; the flat path (one bucket per unit) keeps XLA's."""
    mesh = gpu_mesh("h100", "1 x 1 x 8", (8,), ("dp",))
    options = step_compiler_options(mesh, ZeroConfig(strategy=strategy, path=path), 1)
    kind = {"no_shard": "all_reduces", "optim_grads_params": "gathers"}.get(strategy, "reductions")
    want = {} if path == "flat" else COMBINE[kind]
    assert options == {**pipeline_options(mesh.devices.flat[0]), **want,
                       "xla_gpu_enable_while_loop_double_buffering": True}  # fmt: skip


@needs_gpu_plugin
@pytest.mark.parametrize("path", ["spec", "flat"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_hsdp_pipelines_no_all_reduce(strategy, path):
    """Under HSDP the all-reduces across dp_outer are not pipelined and the loop is not double buffered;
    on the spec path they are combined, and DDP's reduce-scatter, all-reduce and all-gather per grad are
    all three combined. The flat path's DDP (one all-reduce of each bucket over the whole domain) keeps the
    options of one host."""
    mesh = gpu_mesh("h100", "2 x 1 x 8", (2, 8), ("dp_outer", "dp"))
    options = step_compiler_options(mesh, ZeroConfig(strategy=strategy, path=path), 1)
    pipeline = pipeline_options(mesh.devices.flat[0])
    assert [k for k in pipeline if k.endswith("all_reduce")]
    if path == "flat" and strategy == "no_shard":
        assert options == {**pipeline, "xla_gpu_enable_while_loop_double_buffering": True}
        return
    spec = COMBINE["hierarchical"] if strategy == "no_shard" else COMBINE["reductions"] | COMBINE["all_reduces"]
    combine = {} if path == "flat" else spec
    assert options == {**{k: v for k, v in pipeline.items() if not k.endswith("all_reduce")}, **combine,
                       "xla_gpu_enable_while_loop_double_buffering": False}  # fmt: skip


@needs_gpu_plugin
@pytest.mark.parametrize("path", ["spec", "flat"])
def test_hsdp_zero3_keeps_two_collectives_in_flight(path, monkeypatch):
    """Under HSDP across hosts, ZeRO-3 lets XLA keep two collectives in flight (the all-reduce across dp_outer
    beside the gathers and reduce-scatters inside), where this XLA knows the option; ZeRO-2, one host's ZeRO-3
    (the test above has their options whole) and HSDP inside one host do not."""
    import jax
    import jax.numpy as jnp

    from jzero.zero.common import compiler

    mesh = gpu_mesh("h100", "2 x 1 x 8", (2, 8), ("dp_outer", "dp"))
    options = step_compiler_options(mesh, ZeroConfig(strategy="optim_grads_params", path=path), 1)
    assert compiler.TWO_IN_FLIGHT.items() <= options.items()
    assert not compiler.TWO_IN_FLIGHT.keys() & step_compiler_options(mesh, ZeroConfig(strategy="optim_grads"), 1).keys()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding)).compile(
        compiler_options=options
    )
    one_host = gpu_mesh("h100", "1 x 1 x 8", (2, 4), ("dp_outer", "dp"))  # dp_outer inside a host: NVLink alone
    one_host_options = step_compiler_options(one_host, ZeroConfig(strategy="optim_grads_params", path=path), 1)
    assert not compiler.TWO_IN_FLIGHT.keys() & one_host_options.keys()
    monkeypatch.setattr(compiler, "TWO_IN_FLIGHT", {"xla_gpu_no_such_overlap_limit": 2})
    options = step_compiler_options(mesh, ZeroConfig(strategy="optim_grads_params", path=path), 1)
    assert "xla_gpu_no_such_overlap_limit" not in options


@needs_gpu_plugin
def test_dp_between_hosts_beside_tp_or_ep_inside_keeps_two_collectives_in_flight():
    """Without HSDP, ZeRO-1/2/3 let XLA keep two collectives in flight where the DP collectives cross hosts and tp's
    or ep's stay inside one (two links); not DDP, not DP alone across hosts (one link), not tp across hosts."""
    from jzero.zero.common import compiler

    def two(topology, shape, axes, strategy="optim_grads"):
        mesh = gpu_mesh("h100", topology, shape, axes)
        return compiler.TWO_IN_FLIGHT.items() <= step_compiler_options(mesh, ZeroConfig(strategy=strategy), 1).items()

    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        assert two("8 x 1 x 8", (8, 8), ("dp", "tp"), strategy)  # LLaMA-2-70B's 64 H100s
    assert two("8 x 1 x 8", (8, 8), ("dp", "ep"))  # Mixtral-8x7B's
    assert not two("8 x 1 x 8", (8, 8), ("dp", "tp"), "no_shard")
    assert not two("2 x 1 x 8", (16,), ("dp",))  # every DP collective on the network
    assert not two("1 x 1 x 8", (2, 4), ("dp", "tp"))  # one host: both on NVLink
    assert not two("4 x 1 x 2", (2, 4), ("dp", "tp"))  # tp across hosts too
