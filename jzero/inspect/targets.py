"""GPU targets, for compiling a GPU pod's program on a machine with no GPU (docs/xla.md, "Deviceless GPU compilation").

XLA's CUDA compiler needs only a description of the card (a `GpuTargetConfigProto`:
SM count, compute capability, memory size, ...), not the card. With the CUDA PJRT
plugin of the installed jaxlib's exact version (`pip install -e .[gpu-aot]`),
`gpu_mesh("h100", "4 x 1 x 8", ...)` returns a mesh of compile-only devices;
`jax.jit(f).lower(*ShapeDtypeStructs).compile()` on it gives the real GPU program
(`as_text()`, `memory_analysis()`), never runs it.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # JAX is imported where devices are made: `jzero hlo` checks --topology before JAX starts
    from jax.sharding import Mesh

_TARGET_DIR = Path(__file__).parent / "gpu_targets"


@dataclass(frozen=True)
class GpuTarget:
    """One GPU model.

    Attributes:
      name: short key in `TARGETS` ("h100").
      config_file: the `GpuTargetConfigProto` text file under `gpu_targets/`.
      device_kind: the card's name as XLA reports it.
      memory_bytes: HBM per device (the file's `device_memory_size`).
      hbm_bandwidth: HBM bytes/s (the file's `memory_bandwidth`; `roofline`).
    """

    name: str
    config_file: str
    device_kind: str
    memory_bytes: int
    hbm_bandwidth: float

    def config_text(self) -> str:
        """The target description, as `get_topology_desc(target_config=...)` takes it."""
        return (_TARGET_DIR / self.config_file).read_text()


def _load(name: str, config_file: str, public_memory_gb: int, public_bandwidth_gbs: int) -> GpuTarget:
    text = (_TARGET_DIR / config_file).read_text()
    memory = re.search(r"device_memory_size:\s*(\d+)", text)
    bandwidth = re.search(r"memory_bandwidth:\s*(\d+)", text)
    kind = re.search(r'device_description_str:\s*"([^"]*)"', text)
    return GpuTarget(
        name=name,
        config_file=config_file,
        device_kind=kind.group(1) if kind else name.upper(),
        memory_bytes=int(memory.group(1)) if memory else public_memory_gb * 10**9,
        hbm_bandwidth=float(bandwidth.group(1)) if bandwidth else public_bandwidth_gbs * 1e9,
    )


TARGETS: dict[str, GpuTarget] = {
    "h100": _load("h100", "h100_sxm.txtpb", 80, 3350),  # H100 SXM 80GB HBM3, 3.35 TB/s
    "a100": _load("a100", "a100_sxm_80.txtpb", 80, 2039),  # A100 SXM4 80GB, 2.04 TB/s
    "h200": _load("h200", "h200.txtpb", 141, 4800),  # H200 141GB HBM3e, 4.8 TB/s
}


# The most GPUs a topology may hold: 2**17, above the largest single training clusters (~100k GPUs). XLA reads
# each factor as an int32 (2**31 and up: an INTERNAL error), and makes one device per GPU before any compile
# (2**17: ~1 s, 2**20: ~15 s, and a program to compile for each).
MAX_TOPOLOGY_GPUS = 2**17


def parse_topology(text: str) -> tuple[int, int, int]:
    """`"4 x 1 x 8"` -> (4, 1, 8): slices x hosts per slice x GPUs per host, at most `MAX_TOPOLOGY_GPUS` in all.

    Raises:
      ValueError: not three positive integers, or more GPUs than `MAX_TOPOLOGY_GPUS`.
    """
    parts = [p.strip() for p in text.lower().split("x")]
    if len(parts) != 3 or not all(p.isascii() and p.isdecimal() and int(p) > 0 for p in parts):
        raise ValueError(
            f"GPU topology {text!r} must be 'slices x hosts_per_slice x gpus_per_host' "
            f"with three positive integers, e.g. '4 x 1 x 8'"
        )
    shape = int(parts[0]), int(parts[1]), int(parts[2])
    if math.prod(shape) > MAX_TOPOLOGY_GPUS:
        raise ValueError(
            f"GPU topology {text!r} has {math.prod(shape)} GPUs, more than the {MAX_TOPOLOGY_GPUS} (2**17) jzero "
            "compiles for (above the largest training clusters; XLA makes each GPU's device first)"
        )
    return shape


PLUGIN_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda12-pjrt")  # what the gpu-aot extra installs


class CudaPluginError(RuntimeError):
    """The CUDA PJRT plugin is missing or is not jaxlib's version; the one-line message says what to install."""


def install_command(version: str) -> str:
    """The pip command that installs the CUDA PJRT plugin of jaxlib `version`."""
    return "pip install " + " ".join(f'"{dist}=={version}"' for dist in PLUGIN_DISTRIBUTIONS)


def _install_hint() -> str:
    v = importlib.metadata.version("jaxlib")
    hint = "Deviceless GPU compilation needs the CUDA PJRT plugin: pip install -e .[gpu-aot]"
    return f"{hint} (or: {install_command(v)})"


def plugin_mismatch() -> str | None:
    """One line naming the installed plugin wheels whose version is not jaxlib's, with the fix; None if all match.

    The plugin is compiled against one jaxlib. Given another, jaxlib only warns and drops the plugin's
    extension, while JAX still loads its PJRT library (seen: a 0.10.1 plugin compiled for jaxlib
    0.10.2); jzero refuses instead of compiling with a mismatched pair.
    """
    jaxlib_version = importlib.metadata.version("jaxlib")
    wrong = []
    for dist in PLUGIN_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if version != jaxlib_version:
            wrong.append(f"{dist} {version}")
    if not wrong:
        return None
    return (
        f"the CUDA PJRT plugin must match jaxlib exactly, but jaxlib is {jaxlib_version} and the plugin is "
        f"{', '.join(wrong)}; fix: {install_command(jaxlib_version)}"
    )


def cuda_plugin_available() -> bool:
    """Whether the CUDA PJRT plugin (jax-cuda12-plugin + jax-cuda12-pjrt) is importable."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return False
    return True


# The cuDNN a deviceless trace assumes: jax-cuda12-plugin's wheels bundle cuDNN 9.8 (cudnnGetVersion's 90800).
DEVICELESS_CUDNN_VERSION = 90800


def _cudnn_version_for_tracing() -> None:
    """Lets cuDNN's fused attention trace on a host without cuDNN: JAX asks the local cuDNN its version when
    the kernel is traced (to choose features), not when XLA compiles it; without one it gets
    `DEVICELESS_CUDNN_VERSION`. Where cuDNN is installed, its own version still answers."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:  # a JAX without it: nothing to trace
        return
    asked = getattr(fused, "check_cudnn_version", None)
    if asked is None or getattr(asked, "jzero_fallback", False):
        return

    def version() -> int:
        try:
            return asked()
        except RuntimeError:  # "cuDNN not found."
            return DEVICELESS_CUDNN_VERSION

    version.jzero_fallback = True
    fused.check_cudnn_version = version


def gpu_topology(target: str, topology: str):
    """Compile-only devices for a pod of `target` GPUs laid out as `topology`.

    Raises:
      ValueError: unknown target or malformed topology.
      CudaPluginError: the CUDA plugin is not installed, or not jaxlib's version (the message says
        what to install).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; known: {sorted(TARGETS)}")
    shape = parse_topology(topology)
    try:
        import jax_plugins.xla_cuda12 as cuda_plugin
    except ImportError as e:
        raise CudaPluginError(_install_hint()) from e
    mismatch = plugin_mismatch()
    if mismatch:
        raise CudaPluginError(mismatch)
    from jax.experimental import topologies

    # No CUDA runtime here, so the plugin's version check would fail and JAX would drop
    # the plugin; the check only matters for running, not for compiling.
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    _cudnn_version_for_tracing()
    kwargs = dict(topology=" x ".join(map(str, shape)), target_config=TARGETS[target].config_text())
    try:
        return topologies.get_topology_desc("pod", "cuda", **kwargs)
    except NotImplementedError:
        # JAX discovered its plugins before the variable was set, and the plugin failed
        # its check then: register it again now that the check is skipped.
        cuda_plugin.initialize()
        return topologies.get_topology_desc("pod", "cuda", **kwargs)


def gpu_mesh(target: str, topology: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Mesh:
    """A mesh of compile-only `target` GPUs, e.g. `gpu_mesh("h100", "2 x 2 x 8", (4, 8), ("dp", "tp"))`.

    Arguments:
      target: a key of `TARGETS`.
      topology: "slices x hosts_per_slice x gpus_per_host"; its product is the device count.
      mesh_shape: the mesh's shape; its product must equal the device count.
      axis_names: one name per mesh dimension.

    Returns:
      A `Mesh` (Auto axes) to build `NamedSharding`s for lowering; nothing can run on it.
    """
    n = math.prod(parse_topology(topology))
    if math.prod(mesh_shape) != n or len(mesh_shape) != len(axis_names):
        raise ValueError(
            f"mesh shape {tuple(mesh_shape)} with axes {tuple(axis_names)} does not fit "
            f"topology {topology!r} of {n} devices"
        )
    from jax.experimental import topologies

    return topologies.make_mesh(gpu_topology(target, topology), tuple(mesh_shape), tuple(axis_names))
