"""A non-editable install (`pip install .`, a wheel) runs `jzero train` from any directory, presets by name too:
`jzero/configs` links the top-level `configs/`, whose files pyproject's package data copies into the wheel, and
`jzero.config.presets` finds them through the package's resources, in a checkout and in an install alike.
docs/testing.md, "A non-editable install", has the check in a virtualenv by hand."""

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from jzero.config import load_config, presets

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def test_every_config_is_a_preset_of_the_package():
    assert (ROOT / "jzero" / "configs").resolve() == (ROOT / "configs").resolve()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "configs/*.yaml" in package_data["jzero"]
    assert presets() == CONFIGS and "default" in CONFIGS
    for name in CONFIGS:
        assert load_config(name) == load_config(ROOT / "configs" / f"{name}.yaml"), name


@pytest.mark.slow
def test_the_wheel_holds_the_presets_and_loads_them_by_name(tmp_path):
    """`pip wheel` of a copy of the sources, built as `pip install .` builds (in an isolated environment with
    pyproject's setuptools, from the package index), then jzero imported from that wheel in another
    directory: the presets are its own files and load by name."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "configs", src / "configs")
    shutil.copytree(ROOT / "jzero", src / "jzero", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", "dist", "./src"]
    subprocess.run(build, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("jzero-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"jzero/configs/{name}.yaml" for name in CONFIGS} <= names
    assert any(n.startswith("jzero/inspect/gpu_targets/") for n in names)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = "import jzero, jzero.config as c; print(jzero.__file__); print(*c.presets()); c.load_config('llama2_7b')"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env={"PYTHONPATH": str(wheel), "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.splitlines()  # fmt: skip
    assert out[0].startswith(str(wheel)) and out[1].split() == CONFIGS
