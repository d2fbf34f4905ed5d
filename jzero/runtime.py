"""Starting JAX: the simulated CPU device count, the platform, and multi-process runs.

Everything that starts JAX for a config goes through `start_jax`: the CLI's commands, the
inspect tools and the experiments. It must run before JAX's backend initialises (the CPU
device count cannot change afterwards), so this module imports JAX only inside it.

On a GPU host nothing here points JAX away from the GPUs: JAX_PLATFORMS is left alone, and
the mesh is built on `jax.devices()`, the default backend's devices (CUDA's outrank the CPU's),
so the simulated CPU devices exist but no mesh uses them. `mesh.dp=-1` is filled in from the
device count once JAX has started (`jzero.config.resolve_mesh`, called by `jzero.train.loop.setup`).
"""

from __future__ import annotations

import os
from pathlib import Path


def start_jax(
    host_devices: int,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    distributed: bool = False,
) -> None:
    """Sets up JAX for this process; call before any JAX computation.

    Arguments:
      host_devices: simulated CPU devices of this process (`train.host_devices`): a CPU setting;
        on a GPU host it sizes only the CPU backend, which the mesh does not use.
      coordinator: "HOST:PORT" of process 0, to join a multi-process run by hand (with
        `num_processes` and `process_id`); CPU processes then use gloo collectives.
      distributed: join a multi-process run whose cluster (SLURM, Open MPI, ...) JAX detects.

    On a machine with no NVIDIA device JAX_PLATFORMS defaults to cpu, so an installed CUDA
    plugin (the gpu-aot extra, for deviceless compilation) does not fail loudly trying to
    start a GPU backend.
    """
    if "JAX_PLATFORMS" not in os.environ and not Path("/dev/nvidiactl").exists():
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", host_devices)
    except RuntimeError:
        pass  # JAX already started in this process; make_mesh reports a device-count mismatch
    if coordinator:
        if os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    elif distributed:
        jax.distributed.initialize()
