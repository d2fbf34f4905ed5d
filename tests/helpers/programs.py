"""Small real programs the inspect tests compile: on 8 simulated CPU devices, and, where the CUDA
plugin is installed, deviceless for 8 H100s (docs/xla.md, "Deviceless GPU compilation")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.inspect.targets import cuda_plugin_available, gpu_mesh

D = 1024
needs_gpu_plugin = pytest.mark.skipif(
    not cuda_plugin_available(), reason="CUDA PJRT plugin not installed: pip install -e .[gpu-aot]"
)


def cpu_mesh():
    return Mesh(np.asarray(jax.devices()[:8]), ("dp",))


def h100_mesh():
    return gpu_mesh("h100", "1 x 1 x 8", (8,), ("dp",))


def sds(shape, mesh, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def grad_then_reduce(mesh, reduce: str):
    """One rank's grad of a [D, D] weight (its local grad), then psum (DDP) or psum_scatter (ZeRO)."""

    def body(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(jax.lax.pcast(w, "dp", to="varying"))
        if reduce == "psum":
            return w - 0.1 * jax.lax.psum(g, "dp")
        return 0.5 * jax.lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True)

    out = P() if reduce == "psum" else P("dp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=out))
    return f.lower(sds((D, D), mesh, P()), sds((64, D), mesh, P("dp")))
