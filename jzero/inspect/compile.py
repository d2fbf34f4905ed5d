"""Compile a config's train step without running it, for the local devices or a GPU pod.

Nothing is allocated: the train state and the batch are `ShapeDtypeStruct`s carrying
their shardings, and `jax.jit(step).lower(...).compile()` gives the program XLA would
run (`as_text()` for the collectives, `memory_analysis()` for the bytes). For a GPU
target the devices are compile-only (docs/xla.md, "Deviceless GPU compilation"): the CUDA compiler needs a
description of the card, not the card.

What `Compiled` does not expose on GPU, the buffer assignment and the values' live ranges
(`memory_analysis()`'s `serialized_buffer_assignment_proto` is empty there, and has no live
ranges on CPU), XLA writes to its dump: `compile_with_dump` compiles with
`compiler_options={"xla_dump_to": tmpdir}`, which changes what XLA writes, not what it builds
(the same `as_text()` and `memory_analysis()` on CPU and H100, jax 0.10.2), and keeps the texts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp

from jzero.config import GPT_IMPL, AttentionImpl, Config, ConfigError, validate
from jzero.mesh import AUTO_DP, AXES
from jzero.run import Run, build_run
from jzero.zero.common.state import TrainState
from jzero.zero.config import ShardingStrategy, ZeroPath

CPU = "cpu"
GPUS_PER_HOST = 8  # the default topology's hosts (DGX/HGX H100 and A100)
# XLA's dump files that `XlaDump` keeps, by the end of their names (the start names the module
# and, on GPU, the compute capability: `module_0042.jit_step.sm_9.0a_gpu_after_optimizations.txt`).
_DUMP_SUFFIXES = {
    "buffer_assignment": "after_optimizations-buffer-assignment.txt",
    "live_range": "after_optimizations-live-range.txt",
    "hlo": "after_optimizations.txt",
}


@dataclasses.dataclass(frozen=True)
class XlaDump:
    """XLA's after-optimizations dump of one compile: the texts `peak.peak` reads.

    Attributes:
      buffer_assignment: `*after_optimizations-buffer-assignment.txt`: the allocations and each
        value's offset in them.
      live_range: `*after_optimizations-live-range.txt`: each value's [start, end] on the
        flattened schedule.
      hlo: `*after_optimizations.txt`: the module whose values those name (XLA:GPU prints an
        async reduce-scatter here as `async-start`, where `as_text()` prints `reduce-scatter-start`).
    """

    buffer_assignment: str
    live_range: str
    hlo: str


@contextlib.contextmanager
def _without_persistent_cache():
    """JAX's persistent compilation cache (if the user has one) off for a compile: its key leaves out
    `xla_dump_to`, so a hit would return the program without XLA running, and write no dump. JAX
    decides once per process whether the cache is used; `reset_cache` makes it decide again."""
    from jax._src import compilation_cache  # no public switch for one compile

    reset = getattr(compilation_cache, "reset_cache", lambda: None)
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        reset()


def compile_with_dump(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, XlaDump]:
    """Compiles `lowered` once with XLA's dump on; the compiled program and its `XlaDump`."""
    texts = {}
    with tempfile.TemporaryDirectory(prefix="jzero-xla-dump-") as tmp, _without_persistent_cache():
        compiled = lowered.compile(compiler_options={"xla_dump_to": tmp})
        for key, suffix in _DUMP_SUFFIXES.items():
            found = sorted(glob.glob(os.path.join(tmp, f"*{suffix}")))
            if not found:
                raise RuntimeError(f"XLA wrote no *{suffix} to its dump directory")
            with open(found[-1]) as f:
                texts[key] = f.read()
    return compiled, XlaDump(**texts)


@dataclasses.dataclass
class CompiledStep:
    """One config's train step, compiled for a target.

    Attributes:
      run: what `jzero.run.build_run` built (the model, `run.zero`: plan, shardings, jitted step); no dataset.
      compiled: the compiled step (`as_text()`, `memory_analysis()`); it cannot run on a GPU target.
      state: the abstract `TrainState`, leaves `ShapeDtypeStruct`s with their NamedShardings.
      target: "cpu" or a key of `targets.TARGETS`.
      topology: "slices x hosts x gpus" of a GPU target, None on cpu.
      compile_s: seconds spent in lower + compile.
      dump: XLA's dump of this compile (`compile_step(..., dump=True)`), else None.
    """

    run: Run
    compiled: jax.stages.Compiled
    state: TrainState
    target: str
    topology: str | None
    compile_s: float
    dump: XlaDump | None = None

    @property
    def cfg(self) -> Config:
        return self.run.cfg


def default_topology(n_devices: int) -> str:
    """One host up to 8 GPUs, else hosts of 8: 8 -> "1 x 1 x 8", 64 -> "8 x 1 x 8"."""
    if n_devices <= GPUS_PER_HOST:
        return f"1 x 1 x {n_devices}"
    if n_devices % GPUS_PER_HOST:
        raise ConfigError(f"{n_devices} GPUs do not fill hosts of {GPUS_PER_HOST}; pass --topology explicitly")
    return f"{n_devices // GPUS_PER_HOST} x 1 x {GPUS_PER_HOST}"


def target_devices(cfg: Config, target: str, topology: str | None) -> tuple[list | None, str | None]:
    """The devices to build `cfg`'s mesh on, in the order `make_mesh` reshapes them, and the topology.

    cpu: (None, None): the local devices. A GPU target: the compile-only devices of `topology`,
    which must number exactly the mesh's size; default `default_topology(cfg.n_devices)`, or one
    host of 8 GPUs when `mesh.dp=-1` leaves the size open (dp then takes what the others leave).
    """
    if target == CPU:
        if topology is not None:
            raise ConfigError("--topology describes a GPU pod; use it with --target h100, a100 or h200")
        return None, None
    from jzero.inspect import targets

    given = topology is not None
    topology = topology or default_topology(GPUS_PER_HOST if cfg.mesh.dp == AUTO_DP else cfg.n_devices)
    try:
        n = math.prod(targets.parse_topology(topology))
    except ValueError as e:  # a topology made from the mesh is the mesh's fault, not --topology's
        raise ConfigError(f"--topology: {e}" if given else f"the mesh's {cfg.n_devices} devices: {e}") from None
    m = cfg.mesh.resolve(n)
    shape = (m.dp_outer, m.dp, m.ep, m.tp)
    if math.prod(shape) != n:
        raise ConfigError(
            f"mesh dp_outer*dp*ep*tp = {m.dp_outer}*{m.dp}*{m.ep}*{m.tp} = {math.prod(shape)} does not fit "
            f"--topology {topology!r} of {n} GPUs (set mesh sizes whose product is {n})"
        )
    try:
        mesh = targets.gpu_mesh(target, topology, shape, AXES)
    except targets.CudaPluginError as e:  # missing, or not jaxlib's version: the message says what to install
        raise ConfigError(str(e)) from None
    return list(mesh.devices.flat), topology


def with_zero(
    cfg: Config, strategy: ShardingStrategy | str | None = None, path: ZeroPath | str | None = None
) -> Config:
    """`cfg` with another ZeRO strategy and/or path, validated."""
    zero = cfg.zero
    if strategy is not None:
        zero = dataclasses.replace(zero, strategy=ShardingStrategy(strategy))
    if path is not None:
        zero = dataclasses.replace(zero, path=ZeroPath(path))
    cfg = dataclasses.replace(cfg, zero=zero)
    validate(cfg)
    return cfg


def setup_without_data(cfg: Config, devices: list | None) -> Run:
    """`cfg`'s run without its dataset (`jzero.run.build_run`: the model `model.impl` names, its ZeRO
    run), which compiling never reads (and which can be costly: the synthetic chain is a [V, V]
    matrix, 8 GB at LLaMA's V = 32000)."""
    return build_run(cfg, devices)


def abstract_state(run: Run) -> TrainState:
    """The train state as `ShapeDtypeStruct`s in `run.zero.shardings` (traced, never allocated)."""
    shapes = jax.eval_shape(run.init_state)
    return jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), run.zero.shardings, shapes)


def as_on_gpu(cfg: Config) -> Config:
    """`cfg` with jzero's GPT's `model.attention: auto` chosen as on a GPU (cuDNN's fused kernel for bf16/fp16):
    a deviceless compile traces the step on this host, whose backend is not the target's."""
    m = cfg.model
    if m.impl != GPT_IMPL or m.attention != AttentionImpl.AUTO:
        return cfg
    if m.attention.kernel(cfg.precision.param_dtype.value, m.d_model // m.n_heads, "gpu") != "cudnn":
        return cfg  # auto chooses XLA's on this host too
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attention=AttentionImpl.CUDNN))


def compile_step(cfg: Config, target: str = CPU, topology: str | None = None, *, dump: bool = True) -> CompiledStep:
    """Builds `cfg`'s run on the target's devices and compiles one train step on abstract inputs.

    Arguments:
      cfg: a validated config; its zero.strategy and zero.path select the step; `mesh.dp=-1` takes
        the target's devices (the local ones, or the GPU topology's).
      target: "cpu" (the local, possibly simulated, devices) or a GPU target ("h100", ...).
      topology: a GPU target's "slices x hosts_per_slice x gpus_per_host".
      dump: compile with XLA's dump on and keep its texts (`CompiledStep.dump`, what `peak`
        reads): the same program, at no measurable compile time; `False` where the peak is not wanted.

    Raises:
      ConfigError: the mesh does not fit the devices or topology, or the CUDA plugin is missing.
    """
    devices, topology = target_devices(cfg, target, topology)
    cfg = cfg if target == CPU else as_on_gpu(cfg)
    run = setup_without_data(cfg, devices)  # resolves mesh.dp=-1 against the devices
    cfg = run.cfg
    state = abstract_state(run)
    batch = jax.ShapeDtypeStruct(
        (cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32, sharding=run.zero.batch_sharding
    )
    t0 = time.perf_counter()
    lowered = run.zero.step.lower(state, batch)
    compiled, xla_dump = compile_with_dump(lowered) if dump else (lowered.compile(), None)
    return CompiledStep(run, compiled, state, target, topology, time.perf_counter() - t0, xla_dump)
