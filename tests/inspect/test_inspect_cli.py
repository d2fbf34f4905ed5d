"""`jzero hlo` and `jzero memory` end to end: compile the step (nothing runs), read the program.

The collectives parser itself is tested in test_hlo.py; here the commands' numbers are checked
against what the layout and the formulas say they must be.
"""

import json
import sys

import pytest

from helpers.commands import TINY, jzero, needs_cuda
from jzero.config import load_config
from jzero.inspect.commands import TARGET_CHOICES
from jzero.inspect.targets import TARGETS


def hlo_doc(tmp_path, *argv) -> dict:
    out = tmp_path / "hlo.json"
    assert jzero(["hlo", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def rows(doc, strategy, kind) -> list[dict]:
    return [r for r in doc["strategies"][strategy]["collectives"] if r["kind"] == kind]


def test_target_choices_are_the_shipped_targets():
    assert set(TARGET_CHOICES) == {"cpu", *TARGETS}


@pytest.mark.slow
def test_flat_path_collectives_are_the_buffers(tmp_path, capsys):
    """Flat path on 8 CPU devices: the DP collectives move exactly Megatron's padded buffer."""
    from jzero.inspect.compile import setup_without_data

    whole = ["--set", "zero.overlap_grad_reduce=false"]  # one layout over the whole model, one bucket
    doc = hlo_doc(tmp_path, "--path", "flat", "--strategies", "no_shard,optim_grads", *whole)
    cfg = load_config(None, ["zero.path=flat", "zero.overlap_grad_reduce=false", *TINY])
    fp = setup_without_data(cfg, None).zero.flat
    buffer_bytes = 4 * fp.layout.bucket_indices[-1][1]  # fp32 grads and params, one bucket, padded
    d = 8

    # Schema: what `--json` promises (docs/inspect.md).
    assert doc["schema"] == "jzero.hlo/2" and doc["path"] == "flat" and doc["d"] == d
    assert {"target", "topology", "device_kind", "n_devices", "mesh", "params", "config", "strategies"} <= set(doc)
    for s in doc["strategies"].values():
        assert {
            "compile_s",
            "collectives",
            "dp_wire_bytes",
            "dp_wire_bytes_by_kind",
            "theory",
            "ratio",
            "notes",
        } <= set(s)
        for r in s["collectives"]:
            assert set(r) == {"kind", "axes", "dtypes", "count", "payload_bytes", "wire_bytes"}

    (rs,) = rows(doc, "optim_grads", "reduce-scatter")
    (ag,) = rows(doc, "optim_grads", "all-gather")
    assert (rs["axes"], rs["count"], rs["payload_bytes"]) == (["dp"], 1, buffer_bytes)
    assert (ag["axes"], ag["count"], ag["payload_bytes"]) == (["dp"], 1, buffer_bytes)
    assert rs["wire_bytes"] == ag["wire_bytes"] == (d - 1) / d * buffer_bytes
    # DDP all-reduces the same buffer (plus the loss scalar, combined into it or not).
    ddp = [r for r in rows(doc, "no_shard", "all-reduce") if r["axes"] == ["dp"]]
    assert 0 <= sum(r["payload_bytes"] for r in ddp) - buffer_bytes <= 16
    assert not rows(doc, "no_shard", "all-gather") and not rows(doc, "no_shard", "reduce-scatter")

    # Theory is on unpadded params: measured/theory is the padding (and a few scalars' bytes).
    th = doc["strategies"]["optim_grads"]["theory"]
    padding = buffer_bytes / th["grad_bytes"]
    assert th["grad_bytes"] == th["param_bytes"] == 4 * doc["params"] and padding > 1
    for s in ("no_shard", "optim_grads"):
        assert doc["strategies"][s]["ratio"] == pytest.approx(padding, abs=1e-3)
    assert "reduce-scatter" in capsys.readouterr().out


@pytest.mark.slow
def test_spec_path_on_cpu_shows_all_reduce_for_zero1(tmp_path, capsys):
    """docs/xla.md (reduce-scatter on XLA:CPU), shown not hidden: XLA:CPU reduces ZeRO-1's grads (left
    to XLA by the spec path) with all-reduce + slice. (ZeRO-2/3 reduce-scatter per unit explicitly, in
    shard_map, so XLA:CPU emits real reduce-scatters for them: tests/inspect/test_fsdp_inspect.py; and so
    does ZeRO-1 with overlap_grad_reduce: tests/zero/spec/test_grads.py.)"""
    doc = hlo_doc(tmp_path, "--strategies", "no_shard,optim", "--set", "zero.overlap_grad_reduce=false")
    z1 = doc["strategies"]["optim"]
    assert not rows(doc, "optim", "reduce-scatter")
    # The grads' all-reduce is DDP's, give or take the scalars (loss, grad norm) reduced beside it.
    ddp_wire = doc["strategies"]["no_shard"]["dp_wire_bytes"]
    assert z1["dp_wire_bytes_by_kind"]["all-reduce"] == pytest.approx(ddp_wire, abs=256)
    assert z1["ratio"] == pytest.approx(1.5, rel=1e-3)  # (2 + 1) / (1 + 1) with fp32 params
    assert doc["strategies"]["no_shard"]["ratio"] == pytest.approx(1.0, rel=1e-3)
    assert any("XLA:CPU has no reduce-scatter pass" in n for n in z1["notes"])
    out = capsys.readouterr().out
    assert "measured/theory 1.50" in out and "no reduce-scatter" in out


@pytest.mark.slow
def test_memory_state_split_matches_formula(tmp_path):
    """bf16 params on 8 CPU devices: the laid-out state is Megatron's 2 + 4/d + 8/d (+ 4 or 4/d)."""
    out = tmp_path / "memory.json"
    assert jzero(["memory", "--json", str(out)], [*TINY, "precision.param_dtype=bfloat16"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "jzero.memory/1" and doc["memory_bytes"] is None
    ddp, z1, z2 = (doc["strategies"][s] for s in ("no_shard", "optim", "optim_grads"))
    p = doc["params"]
    for s in (ddp, z1, z2):
        assert s["fits"] is None
        state, formula = s["state"], s["formula"]
        for part in ("params", "main_params", "grads"):
            assert state[part] == formula[part], part
        # Adam's step counters (int32 scalars) are state but not in the formula.
        assert 0 <= state["optimizer_moments"] - formula["optimizer_moments"] <= 16
        # The compiled arguments are exactly the state, the step counter and this device's batch.
        batch = 32 * 17 * 4 // 8
        c = s["compiled"]
        assert c["argument"] == state["params"] + state["main_params"] + state["optimizer_moments"] + 4 + batch
        assert c["peak"] >= c["argument"] + c["temp"]
    assert ddp["state"]["params"] == 2 * p
    assert ddp["state"]["main_params"] == 4 * p and z1["state"]["main_params"] == 4 * p / 8
    assert z1["formula"]["optimizer_moments"] == ddp["formula"]["optimizer_moments"] / 8 == 8 * p / 8
    assert z1["state"]["grads"] == 4 * p and z2["state"]["grads"] == 4 * p / 8


def test_mesh_must_fit_topology(capsys):
    assert jzero(["hlo", "--target", "h100", "--topology", "4 x 1 x 8"], [*TINY, "mesh.dp=8"]) == 2
    err = capsys.readouterr().err
    assert "mesh dp_outer*dp*ep*tp = 1*8*1*1 = 8 does not fit --topology '4 x 1 x 8' of 32 GPUs" in err
    assert jzero(["memory", "--topology", "1 x 1 x 8"]) == 2
    assert "use it with --target" in capsys.readouterr().err
    assert jzero(["hlo", "--strategies", "optim,zero9"]) == 2
    assert "--strategies: 'zero9' is not one of" in capsys.readouterr().err


@pytest.mark.parametrize(
    "topology, gpus",
    [("1 x 1 x 2147483648", 2147483648), ("65536 x 65536 x 1", 4294967296), ("2 x 256 x 512", 262144)],
)
def test_topology_of_too_many_gpus_is_refused_before_jax_starts(topology, gpus, monkeypatch, capsys):
    """Before, XLA's INTERNAL error (a factor of 2**31 or more) or minutes making devices."""
    from jzero import runtime

    def start(*_, **__):
        raise AssertionError("JAX started before --topology was checked")

    monkeypatch.setattr(runtime, "start_jax", start)
    for command in ("hlo", "memory"):
        assert jzero([command, "--target", "h100", "--topology", topology]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"jzero: error: --topology: GPU topology {topology!r} has {gpus} GPUs, more than the 131072 (2**17) "
            "jzero compiles for (above the largest training clusters; XLA makes each GPU's device first)\n"
        )


def test_a_mesh_of_too_many_gpus_without_topology_names_the_mesh_not_the_flag(capsys):
    """The topology made from the mesh (no --topology given) was refused as "--topology: ..."."""
    argv = ["hlo", "--target", "h100", "--set", "mesh.dp=1048576", "--set", "train.global_batch=1048576"]
    assert jzero(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jzero: error: the mesh's 1048576 devices: GPU topology '131072 x 1 x 8' has 1048576 GPUs")


@pytest.mark.parametrize("path", ["flat", "owned"])
def test_layout_rank_outside_the_resolved_mesh(path, capsys):
    """mesh.dp=-1 (the default): the size is the devices' (the test session's 8), checked once the layout is built;
    before, zero.path=owned ignored --rank."""
    from jzero import cli

    assert cli.main(["layout", "--rank", "99", *(f"--set={o}" for o in [*TINY, f"zero.path={path}"])]) == 2
    err = capsys.readouterr().err
    assert err == "jzero: error: --rank 99 is outside the data-parallel group of size 8\n"


def test_json_never_replaces_a_file(tmp_path, capsys):
    """Refused before anything compiles: before, the report replaced the user's file."""
    mine = tmp_path / "mine.json"
    mine.write_text("precious\n")
    assert jzero(["memory", "--strategies", "optim", "--json", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"jzero: error: --json {mine} exists: jzero never replaces a file it did not write; name a new " \
        "file"
    assert mine.read_text() == "precious\n"
    assert jzero(["hlo", "--json", str(mine / "x.json")]) == 2
    assert f"--json {mine / 'x.json'}: {mine} is a file, not a directory" in capsys.readouterr().err


def test_gpu_target_without_plugin_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)  # makes the import fail
    assert jzero(["hlo", "--target", "h100", "--topology", "1 x 1 x 8"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e .[gpu-aot]" in err and len(err.strip().splitlines()) == 1


@needs_cuda
def test_plugin_not_of_jaxlibs_version_is_one_line_naming_both(monkeypatch, capsys):
    import importlib.metadata

    real = importlib.metadata.version
    jaxlib_version = real("jaxlib")
    fake = {"jax-cuda12-plugin": "0.0.1", "jax-cuda12-pjrt": jaxlib_version}
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: fake.get(dist) or real(dist))
    assert jzero(["hlo", "--target", "h100", "--topology", "1 x 1 x 8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"jaxlib is {jaxlib_version} and the plugin is jax-cuda12-plugin 0.0.1;" in err
    assert f'fix: pip install "jax-cuda12-plugin=={jaxlib_version}" "jax-cuda12-pjrt=={jaxlib_version}"' in err


@needs_cuda
@pytest.mark.parametrize("topology, n, dp", [(None, 8, 4), ("4 x 1 x 8", 32, 16)])
def test_dp_minus_one_fills_the_gpu_topology(topology, n, dp):
    """A GPU target's mesh.dp=-1 takes the topology's GPUs (default: one host of 8), not the local devices."""
    from jzero.inspect.compile import setup_without_data, target_devices

    cfg = load_config(None, [*TINY, "mesh.tp=2"])
    devices, topo = target_devices(cfg, "h100", topology)
    assert len(devices) == n and topo == (topology or "1 x 1 x 8")
    assert setup_without_data(cfg, devices).cfg.mesh.dp == dp


@needs_cuda
@pytest.mark.slow
def test_deviceless_h100_zero1_and_zero2_reduce_scatter(tmp_path):
    """8 H100s, spec path, 4 micro-batches: ZeRO-1 and ZeRO-2 reduce-scatter the grads (no
    full-gradient all-reduce) and, with fp32 params, move what DDP's all-reduce moves
    (docs/megatron.md, "Bytes on the wire"); ZeRO-1 reduces once after the last microbatch, as
    Megatron's distributed optimizer. (At one micro-batch, on CPU:
    tests/zero/spec/test_grads.py's test_zero1_reduce_scatters_per_unit_and_gathers_once.)"""
    micro = ["train.microbatches=4", "train.global_batch=32", "zero.overlap_grad_reduce=false"]
    jzero_args = ["hlo", "--target", "h100", "--topology", "1 x 1 x 8", "--strategies", "no_shard,optim,optim_grads",
                  "--json", str(tmp_path / "hlo.json")]  # ZeRO-3 left out: test_fsdp_inspect.py
    assert jzero(jzero_args, [*TINY, *micro]) == 0
    doc = json.loads((tmp_path / "hlo.json").read_text())
    assert doc["device_kind"] == TARGETS["h100"].device_kind and doc["topology"] == "1 x 1 x 8"
    ddp = doc["strategies"]["no_shard"]
    assert ddp["ratio"] == pytest.approx(1.0, rel=1e-3)
    for name in ("optim", "optim_grads"):
        z = doc["strategies"][name]
        g = z["theory"]["grad_bytes"]
        (rs,) = rows(doc, name, "reduce-scatter")
        assert rs["axes"] == ["dp"] and rs["payload_bytes"] == pytest.approx(g, rel=1e-3)
        assert all(r["payload_bytes"] < 0.01 * g for r in rows(doc, name, "all-reduce"))
        assert z["dp_wire_bytes"] == pytest.approx(ddp["dp_wire_bytes"], abs=64)  # the loss and norm scalars
        assert z["ratio"] == pytest.approx(1.0, rel=1e-3)
    assert not doc["strategies"]["optim"]["notes"]


@needs_cuda
@pytest.mark.slow
def test_deviceless_h100_memory_fits(tmp_path):
    out = tmp_path / "memory.json"
    argv = ["memory", "--target", "h100", "--strategies", "optim_grads", "--json", str(out)]
    assert jzero(argv, [*TINY, "precision.param_dtype=bfloat16", "zero.overlap_grad_reduce=false"]) == 0
    doc = json.loads(out.read_text())
    s = doc["strategies"]["optim_grads"]
    assert doc["memory_bytes"] == TARGETS["h100"].memory_bytes and doc["topology"] == "1 x 1 x 8" and s["fits"]
    # docs/xla.md, "Deviceless GPU compilation": the arguments are 2P + 12P/d (bf16 params; fp32 main
    # params and Adam sharded) + counters + batch.
    p, d = doc["params"], 8
    assert s["compiled"]["argument"] - (2 * p + 12 * p // d) in range(4 + 8 + 32 * 17 * 4 // 8 + 1)


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, odd",
    [
        # cuDNN in a shard_map that leaves tp to the partitioner; forward, its recompute, backward (two layers: a
        # scan of one is unrolled, and XLA may then merge the recompute with the forward)
        (["zero.path=spec", "mesh.tp=2", "model.scan_layers=true", "model.remat=true", "model.n_layers=2"], False),
        (["zero.path=flat"], True),
    ],
)
def test_deviceless_h100_bf16_attention_is_cudnns(extra, odd, capsys):
    """model.attention=auto chooses cuDNN's fused kernel for a GPU target's bf16 step, on both paths (the spec
    path's data-parallel ranks leave tp to the partitioner: the kernel runs in a nested shard_map there), no
    matmul of the step is on fp32 operands (the roofline line would count them), and a
    bf16 head dim cuDNN cannot take is noted. (An fp32 step, XLA's attention, has no note:
    test_deviceless_h100_zero1_and_zero2_reduce_scatter.)"""
    bf16 = [*TINY, "precision.param_dtype=bfloat16", *extra]
    assert jzero(["hlo", "--target", "h100", "--topology", "1 x 1 x 8", "--strategies", "optim_grads"], bf16) == 0
    calls = 3 * 2 if "model.remat=true" in extra else 2
    out = capsys.readouterr().out
    assert f"note: attention: cuDNN's fused kernel ({calls} __cudnn$fmha* custom calls)" in out
    # every matmul of the bf16 step on bf16 operands, the LM head's backward too (docs/precision.md)
    assert "  roofline ~ " in out and "fp32 operands" not in out
    if odd:
        odd_head = [*TINY, "precision.param_dtype=bfloat16", "model.n_heads=1", "model.d_model=160"]  # head dim 160
        assert jzero(["hlo", "--target", "h100", "--topology", "1 x 1 x 8", "--strategies", "optim"], odd_head) == 0
        out = capsys.readouterr().out
        assert "note: attention: XLA's, holding [B, H, T, T] scores (head dim 160; cuDNN's fused kernel takes" in out
