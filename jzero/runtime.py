"""Starting JAX: the simulated CPU device count, the platform, and multi-process runs.

Everything that starts JAX for a config goes through `start_jax`: the CLI's commands, the
inspect tools and the experiments. It must run before JAX's backend initialises (the CPU
device count cannot change afterwards), so this module imports JAX only inside it.

On a GPU host nothing here points JAX away from the GPUs: JAX_PLATFORMS is left alone, and
the mesh is built on `jax.devices()`, the default backend's devices (CUDA's outrank the CPU's),
so the simulated CPU devices exist but no mesh uses them. `mesh.dp=-1` is filled in from the
device count once JAX has started (`jzero.config.resolve_mesh`, called by `jzero.run.build_run`).

A multi-process run (`--coordinator` by hand, `jzero launch --local N`, `--distributed` on a
cluster; docs/cluster.md) ends within bounds, each process with one line saying why. JAX's
own timeouts end in a C++ abort with a stack trace (or never, when a port is shared), so they
are set later than jzero's (`distributed.timeout_s`, `distributed.heartbeat_timeout_s`):

- joining: process 0 first checks that the coordinator port is free; a watchdog thread ends a
  process that has not joined within `timeout_s`; then all check that they were started alike
  (process count, config).
- running: `jzero.peers.Monitor` exchanges heartbeats through JAX's key-value store; a process silent for
  `heartbeat_timeout_s` is lost, and every other one exits naming it.
- leaving: a process that has finished waits at most `timeout_s` for the others (JAX's
  shutdown barrier); one that left is not reported lost.

When process 0 itself dies, the coordinator goes with it and JAX aborts every other process at
once from C++ (jaxlib 0.10's hook to call Python there instead fails with `std::bad_cast`); their
stderr goes through `jzero.fatal`'s filter, which turns that abort into one line naming process 0;
`jzero launch` names process 0 as the one that died.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time

from jzero.config import DistributedConfig
from jzero.errors import ConfigError, RunError, one_line
from jzero.fatal import one_line_abort
from jzero.imports import default_platforms, quiet_cuda_stub
from jzero.peers import KEY, Monitor, die

_SLACK_S = 5  # process 0 holds the coordinator: it gives up this much later, so the others report first
_WHY_NOT = {  # joining timed out: (started by hand, is process 0) -> the likely causes
    (True, True): "one not started, or one given another --num-processes, --coordinator or --process-id?",
    (True, False): "mismatched --num-processes, a duplicate --process-id, or a coordinator that never started?",
    (False, True): "one not started, or the cluster's processes not all in this run?",
    (False, False): "one not started, or the coordinator (process 0) not started or not reachable?",
}


def start_jax(
    host_devices: int,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    distributed: bool = False,
    timeouts: DistributedConfig | None = None,
    config: dict | None = None,
) -> None:
    """Sets up JAX for this process; call before any JAX computation.

    Arguments:
      host_devices: simulated CPU devices of this process (`train.host_devices`): a CPU setting;
        on a GPU host it sizes only the CPU backend, which the mesh does not use.
      coordinator: "HOST:PORT" of process 0, to join a multi-process run by hand (with
        `num_processes` and `process_id`); CPU processes then use gloo collectives.
      distributed: join a multi-process run whose cluster (SLURM, Open MPI, ...) JAX detects.
      timeouts: a multi-process run's bounds (`distributed.*`; default: its defaults).
      config: the run's config (`jzero.config.to_dict`): every process must have the same.

    Raises:
      ConfigError: `distributed` outside a cluster JAX detects.
      RunError: the coordinator port is in use, or the processes were started differently.
    A process that cannot join in time, or loses another, prints one line and exits 2 itself.

    On a machine with no NVIDIA device JAX_PLATFORMS defaults to cpu, so an installed CUDA
    plugin (the gpu-aot extra, for deviceless compilation) does not fail loudly trying to
    start a GPU backend.
    """
    default_platforms()
    with quiet_cuda_stub():
        import jax

    try:
        jax.config.update("jax_num_cpu_devices", host_devices)
    except RuntimeError:
        pass  # JAX already started in this process; make_mesh reports a device-count mismatch
    if coordinator or distributed:
        _join(coordinator, num_processes, process_id, timeouts or DistributedConfig(), config or {})


def _join(coordinator: str | None, n: int | None, me: int | None, t: DistributedConfig, config: dict) -> None:
    """`jax.distributed.initialize`, bounded by `t.timeout_s`, then the agreement and the monitor."""
    import jax
    from jax._src import distributed as jax_distributed  # its client is JAX's key-value store (orbax uses it too)

    wait, by_hand = t.timeout_s, coordinator is not None
    with _Watchdog(wait + _SLACK_S, f"could not detect the cluster within {wait} s (--distributed)") as watchdog:
        if coordinator is None:
            coordinator, n, me = _detect_cluster(wait)
        who = f"process {me} of {n}"
        if me == 0:
            _check_port_free(coordinator, "--coordinator" if by_hand else "JAX_COORDINATOR_PORT")
        else:
            watchdog.deadline -= _SLACK_S
        why = f"not every process joined ({_WHY_NOT[by_hand, me == 0]})"
        watchdog.message = f"could not join the run at {coordinator} within {wait} s as {who}: {why}"
        if os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
        if me != 0:  # JAX's abort when process 0 dies: one line, not a C++ stack (jzero.fatal)
            one_line_abort(
                f"lost the coordinator (process 0 at {coordinator}): it died, and JAX ends the other processes with it"
            )
        try:
            jax.distributed.initialize(
                coordinator, num_processes=n, process_id=me,
                initialization_timeout=2 * wait + 10,  # JAX's timeouts abort in C++: after ours
                heartbeat_timeout_seconds=max(100, 2 * t.heartbeat_timeout_s + 10),
                shutdown_timeout_seconds=2 * wait + 10,
            )
        except Exception as e:  # e.g. the coordinator's RPC server did not start
            raise RunError(f"could not join the run at {coordinator} as {who}: {one_line(e)}") from None
        client = jax_distributed.global_state.client
        flat = {f"{section}.{key}": value for section, keys in config.items() for key, value in keys.items()}
        _agree(client, me, {"--num-processes": n, **flat}, wait)
    Monitor(client, me, n, coordinator, t).start()


def _detect_cluster(timeout_s: int) -> tuple[str, int, int]:
    """(coordinator, process count, process id) as `jax.distributed.initialize()` detects them."""
    from jax._src import clusters  # run here, not inside initialize, to name the run in every message

    try:
        address, n, me, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            os.environ.get("JAX_COORDINATOR_ADDRESS"), None, None, None, None, timeout_s
        )
    except Exception as e:  # e.g. Kubernetes: no permission to read the pod and its job
        raise RunError(f"--distributed: cluster detection failed: {one_line(e)}") from None
    if None in (address, n, me):
        raise ConfigError(
            "--distributed: JAX detected no cluster (SLURM, Open MPI, Kubernetes, ...; docs/cluster.md); "
            "give --coordinator, --num-processes and --process-id instead"
        )
    return address, n, me


def _check_port_free(coordinator: str, setting: str) -> None:
    """Process 0 is about to serve at the coordinator's port. A port in use would hang every
    process until JAX's timeout (gRPC even shares one that another gRPC server holds)."""
    port = int(coordinator.rsplit(":", 1)[1])
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a closed run's TIME_WAIT is free
                s.bind((host, port))
            return
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RunError(
                    f"the coordinator port {port} is already in use on this host (another run, one left over, "
                    f"or a second --process-id 0?): choose a free port with {setting}"
                ) from None
    # Neither family could bind for another reason (no IPv6, say): JAX will report it.


def _agree(client, me: int, facts: dict, timeout_s: int) -> None:
    """Every process publishes how it was started and checks it against process 0's: all of them
    raise the same error if any differs (a different --num-processes is otherwise not noticed)."""
    client.key_value_set(f"{KEY}/join/{me}", json.dumps(facts))
    client.key_value_set(f"{KEY}/beat/{me}", "0")  # the monitor's first heartbeat, before anyone reads it
    client.wait_at_barrier(f"{KEY}/join", timeout_s * 1000)
    started = sorted((int(k.rsplit("/", 1)[1]), json.loads(v)) for k, v in client.key_value_dir_get(f"{KEY}/join/"))
    (_, first), *others = started
    for k, theirs in others:
        for key, value in first.items():
            if theirs.get(key) != value:
                raise RunError(
                    f"process 0 and process {k} were started with different {key} ({value} and "
                    f"{theirs.get(key)}): every process must be given the same"
                )


class _Watchdog:
    """Ends the process with one line unless its `with` block finishes by `deadline`: a hang in
    C++ raises nothing in Python, and JAX's own timeouts end in an abort with a stack trace."""

    def __init__(self, seconds: float, message: str):
        self.deadline, self.message = time.monotonic() + seconds, message
        self._done = threading.Event()

    def __enter__(self) -> _Watchdog:
        threading.Thread(target=self._watch, name="jzero-join-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            if time.monotonic() > self.deadline:
                die(self.message)
