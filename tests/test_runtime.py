"""Fitting the mesh to the devices JAX started with: `mesh.dp=-1`, its validation, the platform."""

import json
import os
import subprocess
import sys

import pytest

from jzero import imports, runtime
from jzero.cli import main
from jzero.config import Config, ConfigError, load_config, resolve_mesh
from jzero.mesh import MeshConfig

TINY = ["model.n_layers=1", "model.seq_len=16", "model.d_model=32", "model.d_ff=64", "data.kind=synthetic"]


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.parametrize(
    "mesh, n_devices, dp",
    [
        (MeshConfig(), 8, 8),
        (MeshConfig(), 1, 1),  # one GPU
        (MeshConfig(tp=2), 8, 4),
        (MeshConfig(ep=2, tp=2), 8, 2),
        (MeshConfig(tp=4), 4, 1),
        (MeshConfig(dp=4, tp=2), 8, 4),  # set: left as it is (make_mesh checks it against the devices)
        (MeshConfig(dp=4, tp=2), 6, 4),
    ],
)
def test_dp_minus_one_takes_the_devices_the_other_axes_leave(mesh, n_devices, dp):
    assert mesh.resolve(n_devices) == MeshConfig(dp=dp, ep=mesh.ep, tp=mesh.tp, dp_outer=mesh.dp_outer)


def test_resolve_mesh_fills_dp_once_and_validates_the_batch_split():
    cfg = load_config()
    assert cfg.mesh.dp == -1  # the default: all devices
    resolved = resolve_mesh(cfg, 8)
    assert resolved.mesh == MeshConfig(dp=8) and resolved.dp_domain_size == 8 and resolved.n_devices == 8
    assert resolve_mesh(resolved, 8) is resolved
    assert resolve_mesh(load_config(None, ["mesh.tp=2"]), 4).mesh == MeshConfig(dp=2, tp=2)
    # global_batch=32 over 6 data-parallel ranks: caught once dp is known, naming the resolved size.
    with pytest.raises(ConfigError, match=r"global_batch=32 must be divisible .*mesh.dp_outer\*mesh.dp\*mesh.ep=6"):
        resolve_mesh(cfg, 6)
    with pytest.raises(ConfigError, match=r"mesh.dp=-1 \(all remaining devices\): 8 devices are not a multiple of "
                       r"mesh.dp_outer\*mesh.ep\*mesh.tp = 1\*3\*1 = 3"):
        resolve_mesh(load_config(None, ["mesh.ep=3"]), 8)
    with pytest.raises(ConfigError, match="mesh.dp=-1 is not resolved"):
        _ = Config().n_devices


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["mesh.dp=0"], "mesh.dp=0 must be >= 1 or -1 (all remaining devices)"),
        (["mesh.dp=-2"], "mesh.dp=-2 must be >= 1 or -1 (all remaining devices)"),
        (["mesh.tp=-1"], "mesh.tp=-1 must be >= 1"),
        (["mesh.ep=0"], "mesh.ep=0 must be >= 1"),
        (["mesh.dp_outer=0"], "mesh.dp_outer=0 must be >= 1"),
    ],
)
def test_mesh_sizes_are_validated_at_load(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == needle
    assert load_config(None, ["mesh.dp=-1"]).mesh.dp == -1 and load_config(None, ["mesh.dp=2"]).mesh.dp == 2


def test_devices_that_do_not_divide_are_one_line_exit_2(capsys, tmp_path):
    assert main(["train", "--out", str(tmp_path), "--quiet", *sets(["mesh.ep=3"])]) == 2
    err = capsys.readouterr().err.strip()
    assert "mesh.dp=-1 (all remaining devices): 8 devices are not a multiple of" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_default_config_trains_on_the_8_simulated_devices(tmp_path, capsys):
    """`jzero train` as shipped (only fewer steps): dp=-1 becomes 8 on this process's 8 CPU devices."""
    assert main(["train", "--out", str(tmp_path), "--quiet", "--set", "train.steps=2"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mesh"] == {"dp_outer": 1, "dp": 8, "ep": 1, "tp": 1}
    assert summary["devices"]["platform"] == "cpu" and summary["devices"]["count"] == 8
    assert "mesh: dp_outer=1 dp=8 ep=1 tp=1 on 8 x cpu" in capsys.readouterr().out


@pytest.mark.slow
def test_dp_follows_the_device_count_of_a_fresh_process(tmp_path):
    """In a process of 2 devices (as on a host of 2 GPUs) the same config trains with dp=2."""
    argv = ["train", "--out", str(tmp_path), "--quiet", *sets([*TINY, "train.steps=1", "train.host_devices=2"])]
    proc = subprocess.run(
        [sys.executable, "-m", "jzero.cli", *argv],
        capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["mesh"]["dp"] == 2


def test_start_jax_leaves_the_platform_to_jax_on_a_gpu_host(monkeypatch):
    """With an NVIDIA device present, JAX picks the GPUs itself; only a host without one is pinned to cpu
    (`jzero.imports.default_platforms`, which also runs before a module the config names is imported)."""
    monkeypatch.delenv("JAX_PLATFORMS")

    class Host:
        def __init__(self, path):
            self.path = path

        def exists(self):
            return self.path == "/dev/nvidiactl"

    monkeypatch.setattr(imports, "Path", Host)
    runtime.start_jax(8)  # JAX has started in this process already: the device count stays
    assert "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(imports.Path, "exists", lambda self: False)
    runtime.start_jax(8)
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_jax_starts_without_the_cuda_plugins_lines():
    """On a machine with no NVIDIA device and the gpu-aot extra, importing JAX and registering its plugins wrote 8
    lines (absl's notice and cudart_stub's "Could not find cuda drivers") before every command's own; what else
    is written to stderr meanwhile comes after, in order (a fresh process: JAX is not imported yet)."""
    code = (
        "import os, sys\n"
        "from jzero.imports import quiet_cuda_stub\n"
        "with quiet_cuda_stub():\n"
        "    import jax\n"
        "    os.write(2, b'mine\\n')\n"
        "    print('also mine', file=sys.stderr)\n"
        "jax.devices()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "mine\nalso mine\n")


def test_only_the_cuda_stubs_lines_are_held_back():
    notice = imports._ABSL_NOTICE + "\n"
    stub = "I0000 00:00:1795850716.744367    9944 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU "
    stub += "will not be used.\n"
    lines = [notice, stub, "kept\n", notice, "W0000 something else\n", stub]
    assert imports._without_stub(lines) == ["kept\n", notice, "W0000 something else\n"]


def test_megatron_names_prints_its_names_alone():
    """`jzero ckpt megatron-names` imported JAX outside `quiet_cuda_stub`: 6 lines of the CUDA plugin's before its
    JSON on a machine without an NVIDIA device (and, held back but with JAX_PLATFORMS unset, the plugin's
    failure to start a GPU backend)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-m", "jzero.cli", "ckpt", "megatron-names"], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "")
    assert json.loads(proc.stdout)["embedding.word_embeddings.weight"] == "tok_emb"
