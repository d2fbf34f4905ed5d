"""A run that cannot fit is refused before anything is compiled or allocated, in one line naming the
bytes (real processes under a real `ulimit -v`); a run the check lets through that still runs out of
memory ends in one line too; the shipped configs pass at their intended device counts."""

import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import stderr_lines

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 12 * 2**30  # ulimit -v: room for JAX and 8 CPU devices, not for these runs


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _train(tmp_path, *sets: str, within: float) -> tuple[str, float]:
    """`jzero train` under the limit: its one stderr line (asserted, with exit 2) and its seconds."""
    args = [a for kv in sets for a in ("--set", kv)]
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jzero.cli", "train", "--out", str(tmp_path / "out"), "--quiet",
                           *args], env=dict(os.environ, JAX_PLATFORMS="cpu"), preexec_fn=_limited,
                          capture_output=True, text=True, timeout=within)
    lines = stderr_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("jzero: error: "), proc.stderr[-3000:]
    return lines[0], time.monotonic() - t


@pytest.mark.parametrize(
    "sets, needle",
    [
        # ~100 GB of state (the traceback: "Out of memory allocating 68719476736 bytes")
        (["model.d_model=65536", "model.d_ff=262144"], "206,186,348,544 params x 16 bytes over 8 devices"),
        # scanned, 4e9 params: building the model alone traced every block for minutes
        (["model.n_layers=20000", "model.scan_layers=true"], "3,957,809,408 params x 16 bytes over 8 devices"),
        # activations: was still compiling or allocating after 190 s
        (["train.global_batch=4194304"], "GiB of activations"),
    ],
)
@pytest.mark.slow
def test_a_run_that_cannot_fit_is_refused_before_compiling(sets, needle, tmp_path):
    line, seconds = _train(tmp_path, *sets, within=60)
    assert line.startswith("jzero: error: the run needs at least ") and needle in line
    assert "the address space `ulimit -v` leaves is" in line and "train.check_memory=false" in line
    advice = "train.microbatches" if "activations" in needle else "zero.strategy=optim_grads"
    assert advice in line
    assert seconds < 30
    assert not (tmp_path / "out").exists()  # refused before the run made anything


@pytest.mark.slow
def test_sizes_xla_cannot_index_are_one_line(tmp_path):
    """Before: a `ValueError: array is too big` (or int32 OverflowError) traceback."""
    line, _ = _train(tmp_path, f"model.vocab_size={2**31}", within=60)
    assert line == ("jzero: error: model.vocab_size=2147483648 is 2**31 or more: token ids are int32 (XLA's "
                    "gathers index with int32); the largest is 2147483647")


@pytest.mark.slow
def test_an_out_of_memory_at_run_time_is_one_line(tmp_path):
    """train.check_memory=false lets a run through that cannot fit: XLA's allocation fails, in one line."""
    line, _ = _train(tmp_path, "train.check_memory=false", "model.d_model=32768", "model.n_layers=1",
                     "model.d_ff=64", "model.seq_len=16", "data.kind=synthetic", within=120)
    assert line.startswith("jzero: error: out of memory during ") and "Out of memory allocating" in line
    assert "zero.strategy" in line and "train.microbatches" in line


def test_out_of_memory_names_a_device_oom_and_not_a_full_disk():
    """TensorStore reports ENOSPC as RESOURCE_EXHAUSTED, as XLA reports a device out of memory: only the
    latter is an out-of-memory; a failure jzero already put in one line is left as it is."""
    import errno

    from jzero.errors import RunError
    from jzero.train.preflight import disk_full, out_of_memory

    xla = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes.")
    oom = out_of_memory(xla, "step")
    assert isinstance(oom, RunError) and str(oom).startswith("out of memory during step (RuntimeError: RESOURCE_EX")
    assert "zero.strategy=optim_grads" in str(oom) and "train.microbatches" in str(oom)
    assert out_of_memory(MemoryError(), "compile") is not None
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing local file "/ck/step_00000002.orbax-checkpoint-tmp/'
                             'state/d/0": Failed to write 292339 bytes to file 4: No space left on device '
                             "[os_error_code='28']")
    python = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ck/step_00000002.orbax-checkpoint-tmp/meta")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/ck/step_00000002.orbax-checkpoint-tmp/meta")
    for full in (tensorstore, python, quota, ValueError(f"RESOURCE_EXHAUSTED: ... {os.strerror(errno.EDQUOT)}")):
        assert disk_full(full) and out_of_memory(full, "step") is None
    saving = RunError("saving checkpoint step 2 to /ck failed: ValueError: RESOURCE_EXHAUSTED: Error writing ...")
    assert out_of_memory(saving, "step") is None
    assert not disk_full(xla) and not disk_full(OSError(errno.EACCES, "Permission denied"))


# Each shipped config on the device count its mesh names, held against an 80 GB H100 at JAX's default
# preallocation (75%), through the check's own comparison (the GPU devices stood in for).
NEEDS = textwrap.dedent("""
    import sys, types
    from jzero.config import load_config
    from jzero.runtime import start_jax
    cfg = load_config(sys.argv[1])
    start_jax(int(sys.argv[2]))
    import jax
    from jzero.run import build_run
    from jzero.train import preflight
    run = build_run(cfg)
    h100 = types.SimpleNamespace(process_index=0, platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                 memory_stats=lambda: {"bytes_limit": int(0.75 * 80e9), "bytes_in_use": 0})
    gpus = [h100] * run.cfg.n_devices
    jax.devices = lambda: gpus
    preflight._compare(run.cfg, gpus, preflight.needed_bytes(run), "")
    preflight.check_floor(cfg, gpus)
    print("fits", {k: round(v / 2**30, 1) for k, v in preflight.needed_bytes(run).items()})
""")


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
@pytest.mark.slow
def test_the_shipped_configs_pass_at_their_intended_device_counts(name):
    import yaml

    mesh = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text()).get("mesh", {})
    devices = mesh.get("dp", 8) * mesh.get("tp", 1) * mesh.get("ep", 1) * mesh.get("dp_outer", 1)
    devices = 8 if mesh.get("dp", -1) == -1 else devices
    proc = subprocess.run([sys.executable, "-c", NEEDS, str(ROOT / "configs" / f"{name}.yaml"), str(devices)],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "fits" in proc.stdout, proc.stderr[-3000:]
