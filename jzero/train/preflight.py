"""Before anything is compiled or allocated: can this run fit? One line naming the bytes if not.

A run that cannot fit used to end in a traceback ("Out of memory allocating ..."), or never: a
compile or an allocation that swaps for minutes. `check_fits` holds a floor of what one device
needs against what it has, and refuses a run whose floor does not fit:

    needed per device  = Megatron's bytes of params, grads and optimizer state (`zero.memory`:
                         per strategy, HSDP and precision), less what `zero.offload_fraction` puts
                         in host memory, plus the model's floor on activations for one micro-batch
                         (`jzero.model.activation_bytes`)
    available          = a GPU's `bytes_limit` less what it holds; for CPU devices, which share the
                         host's memory, the host's available memory (MemAvailable, `ulimit -v`'s
                         address space left, the cgroup's limit) split over this process's devices
    host (offload)     = the offloaded state of this process's devices, against the host's memory

Both sides are conservative (XLA's temporaries are not counted, the available bytes are the most
the process could get), so a run refused here would fail at run time; `train.check_memory: false`
skips the check for a user who knows better. Sizes XLA cannot index (a dimension of 2**31 or more:
token ids and gather indices are int32) are refused the same way. An out-of-memory error that still
happens at run time is reported in one line with the same advice (`out_of_memory`).
"""

from __future__ import annotations

import errno
import math
import os
import resource
from pathlib import Path

import jax
import jax.numpy as jnp

from jzero import model as protocol
from jzero import multihost
from jzero.errors import ConfigError, JzeroError, RunError, one_line
from jzero.zero.memory import formula_host, formula_split

INT32_MAX = 2**31 - 1
ADVICE = (
    "shard more (zero.strategy=optim_grads or optim_grads_params, a larger mesh.dp or mesh.tp, zero.offload_fraction), "
    "or split the batch (train.microbatches)"
)


def check_floor(cfg, devices: list) -> None:
    """The first, cheap check, before the model is built (building traces every block: minutes at
    thousands of layers): the params, grads and optimizer state held once over all `devices`
    (`jzero.model.param_count`; the most sharded layout any strategy reaches), and sizes XLA cannot
    index. ConfigError on every process if they cannot fit."""
    from jzero.config import MomentsDType, OptimizerName, resolve_mesh

    def check():
        _check_vocab_and_batch(cfg)
        n_params = protocol.param_count(cfg)
        if not cfg.train.check_memory or n_params is None:
            return
        n = resolve_mesh(cfg, len(devices)).n_devices
        param_b = jnp.dtype(cfg.precision.param_dtype.value).itemsize
        o = cfg.optimizer
        # Muon keeps one moment per matrix (AdamW's two on the rest): one per param is the floor
        moments = {OptimizerName.SGD: 1 if o.b1 > 0 else 0, OptimizerName.MUON: 1}.get(o.name, 2)
        device_b = param_b + jnp.dtype(cfg.precision.grad_reduce_dtype.value).itemsize
        optimizer_b = (4 if param_b != 4 else 0) + moments * (2 if o.moments_dtype == MomentsDType.BFLOAT16 else 4)
        offload = cfg.zero.offload_fraction  # its share of the optimizer state is in host memory
        need = {
            "state": n_params * (device_b + optimizer_b * (1 - offload)) / n,
            "activations": 0,
            "host": n_params * optimizer_b * offload / n,
        }
        what = f"{n_params:,} params x {device_b + optimizer_b} bytes over {n} devices"
        _compare(cfg, devices[:n], need, what)

    _everywhere(check)


def check_fits(run) -> None:
    """The full check, once the run is built and before anything is allocated or compiled (module
    docstring). ConfigError on every process unless `run` (a `jzero.run.Run`) fits."""

    def check():
        check_indexable(run)
        if run.cfg.train.check_memory:
            need = needed_bytes(run)
            what = (
                f"{_gib(need['state'])} of params, grads and optimizer state + "
                f"{_gib(need['activations'])} of activations"
            )
            _compare(run.cfg, list(run.mesh.devices.flat), need, what)

    _everywhere(check)


def _everywhere(check) -> None:
    failure = None
    try:
        check()
    except ConfigError as e:
        failure = str(e)
    failure = multihost.first_failure(failure)  # one process's refusal is everyone's: none waits in a collective
    if failure is not None:
        raise ConfigError(failure)


def _check_vocab_and_batch(cfg) -> None:
    if cfg.model.vocab_size > INT32_MAX:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is 2**31 or more: token ids are int32 (XLA's gathers index "
            f"with int32); the largest is {INT32_MAX}"
        )
    tokens = cfg.train.global_batch * (cfg.model.seq_len + 1)
    if tokens > INT32_MAX:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} x (model.seq_len + 1)={cfg.model.seq_len + 1} is {tokens} "
            f"tokens, more than int32 indices reach ({INT32_MAX}): lower train.global_batch"
        )


def check_indexable(run) -> None:
    """ConfigError if an array's dimension (a param's, the vocabulary, the batch) is 2**31 or more."""
    _check_vocab_and_batch(run.cfg)
    for path, leaf in jax.tree_util.tree_flatten_with_path(run.model.abstract_params())[0]:
        if any(d > INT32_MAX for d in leaf.shape):
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            raise ConfigError(f"param {name} {list(leaf.shape)} has a dimension of 2**31 or more: XLA cannot index it")


def needed_bytes(run) -> dict:
    """Per device: {"state": device bytes of params, grads and the optimizer state not offloaded,
    "activations": the model's floor for one micro-batch, "host": offloaded state bytes}."""
    cfg, zero = run.cfg, run.zero
    split = formula_split(zero)
    host = sum(formula_host(zero).values()) if cfg.zero.offload_fraction > 0 else 0.0
    rows = cfg.train.global_batch // (cfg.dp_domain_size * cfg.train.microbatches)
    return {
        "state": sum(split.values()) - host,
        "activations": protocol.activation_bytes(run.model, rows, cfg.mesh.tp),
        "host": host,
    }


def host_available_bytes() -> tuple[int, str] | None:
    """(the most host memory this process could still get, what limits it), or None if unknown."""
    found = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        found.append((int(meminfo["MemAvailable"].split()[0]) * 1024, "the host's available memory"))
    except (OSError, KeyError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            used = int(status["VmSize"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            used = 0
        found.append((max(soft - used, 0), "the address space `ulimit -v` leaves"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((max(int(limit) - used, 0), "the cgroup's memory limit"))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _compare(cfg, devices: list, need: dict, what: str) -> None:
    """ConfigError if `need` (per device: state, activations, host) does not fit this process's share
    of `devices` (`what` says where the bytes come from)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    if not local:
        return
    host = host_available_bytes()
    per_device = need["state"] + need["activations"]
    if local[0].platform == "cpu":  # CPU devices (and offloaded state) share the host's memory
        total = len(local) * (per_device + need["host"])
        if host is not None and total > host[0]:
            raise ConfigError(
                f"the run needs at least {_gib(total)} of host memory for its {len(local)} CPU devices "
                f"({_gib(per_device + need['host'])} each: {what}), but {host[1]} is {_gib(host[0])}: "
                f"{_advice(need, cpu=True)}"
            )
        return
    stats = local[0].memory_stats() or {}
    if "bytes_limit" in stats:
        has = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if per_device > has:
            raise ConfigError(
                f"the run needs at least {_gib(per_device)} per device ({what}), but a {local[0].device_kind} "
                f"has {_gib(has)}: {_advice(need, cpu=False)}"
            )
    if need["host"] and host is not None and len(local) * need["host"] > host[0]:
        raise ConfigError(
            f"zero.offload_fraction={cfg.zero.offload_fraction} puts {_gib(len(local) * need['host'])} of "
            f"optimizer state in host memory, but {host[1]} is {_gib(host[0])}: lower zero.offload_fraction, or "
            "shard more (zero.strategy, mesh.dp)"
        )


def _advice(need: dict, cpu: bool) -> str:
    """The settings that would help most, the larger part first; and how to skip the check."""
    if need["activations"] > need["state"]:
        first = "split the batch (train.microbatches, or a smaller train.global_batch)"
        rest = "or shard more (a larger mesh.dp, zero.strategy=optim_grads_params)"
    else:
        first = "shard more (zero.strategy=optim_grads or optim_grads_params, a larger mesh.dp or mesh.tp)"
        rest = "or use a smaller model" if cpu else "or keep optimizer state in host memory (zero.offload_fraction)"
    return f"{first}, {rest}; train.check_memory=false skips this check"


def _gib(n: float) -> str:
    if n < 2**30:
        return f"{math.ceil(n / 1024)} KiB" if n < 2**20 else f"{n / 2**20:.3g} MiB"
    gib = n / 2**30
    return f"{gib:,.0f} GiB" if gib >= 100 else f"{gib:.3g} GiB"


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device, or in the user's quota (clusters)


def disk_full(e: BaseException) -> bool:
    """Whether `e` is a write that found no space left on its device or in its quota (ENOSPC, EDQUOT): Python's
    OSError, or TensorStore's error (a ValueError whose status is RESOURCE_EXHAUSTED, as XLA's out-of-memory is:
    'RESOURCE_EXHAUSTED: Error writing local file ...: No space left on device [os_error_code='28']')."""
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return True
    text = str(e)
    return any(os.strerror(n) in text or f"os_error_code='{n}'" in text for n in _DISK_FULL)


def out_of_memory(e: BaseException, during: str) -> RunError | None:
    """A RunError in one line for an out-of-memory `e` (XLA's RESOURCE_EXHAUSTED) that happened
    `during` a phase; None for any other error: one of jzero's own (already its one line, e.g. a failed
    checkpoint save) and a full disk (TensorStore reports ENOSPC as RESOURCE_EXHAUSTED too)."""
    if isinstance(e, JzeroError) or disk_full(e):
        return None
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text and not isinstance(e, MemoryError):
        return None
    return RunError(f"out of memory during {during} ({one_line(e, 120)}): {ADVICE}")

