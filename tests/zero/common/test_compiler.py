"""The XLA options of a ZeRO step (`jzero/zero/common/compiler.py`): XLA:GPU's collective pipeliner
with overlap on a GPU mesh, nothing on a CPU mesh or without overlap."""

import numpy as np
import pytest
from jax.sharding import Mesh

from helpers.programs import needs_gpu_plugin
from jzero.inspect.targets import gpu_mesh
from jzero.zero.common.compiler import PIPELINE, step_compiler_options
from jzero.zero.config import ZeroConfig


def cpu_mesh():
    import jax

    return Mesh(np.asarray(jax.devices()[:8]), ("dp",))


def test_no_options_on_cpu():
    assert step_compiler_options(cpu_mesh(), ZeroConfig()) == {}


@needs_gpu_plugin
@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_mesh_pipelines_collectives_with_overlap(overlap):
    mesh = gpu_mesh("h100", "1 x 1 x 8", (8,), ("dp",))
    options = step_compiler_options(mesh, ZeroConfig(overlap_grad_reduce=overlap))
    assert options == (PIPELINE if overlap else {})
