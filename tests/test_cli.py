"""Config loading (files and presets by name), one-line config errors, and `jzero train` end to end."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jzero import cli
from jzero.cli import main
from jzero.config import Config, ConfigError, load_config, presets

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "model.n_layers=1", "--set", "model.seq_len=16", "--set", "model.d_model=32", "--set", "model.d_ff=64"]


def test_default_yaml_is_the_embedded_default():
    assert load_config(ROOT / "configs" / "default.yaml") == Config() == load_config()


def test_overrides_are_typed():
    overrides = ["zero.strategy=optim", "optimizer.lr=1e-3", "optimizer.clip_grad=null", "mesh.dp=4", "mesh.tp=2"]
    cfg = load_config(None, overrides)
    assert cfg.zero.strategy.value == "optim" and cfg.optimizer.lr == 1e-3 and cfg.optimizer.clip_grad is None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.foo=1"], "unknown config key model.foo"),
        (["modle.d_model=1"], "unknown config key modle"),
        (["train.steps=abc"], "train.steps='abc' must be of type int"),
        (["zero.strategy=zero9"], "zero.strategy='zero9' is not one of"),
        (["mesh.dp=2", "mesh.tp=4", "model.n_heads=2"], "model.n_heads=2 must be divisible by mesh.tp=4"),
        (["mesh.dp=2", "mesh.tp=4", "model.d_ff=510"], "model.d_ff=510 must be divisible by mesh.tp=4"),
        (["train.global_batch=12"], "train.global_batch=12 must be divisible by the data-parallel size"),
        (["train.microbatches=3"], "train.microbatches=3"),
        (["model.d_model=100", "model.n_heads=3"], "model.d_model=100 must be divisible by model.n_heads=3"),
        (["mesh.dp=4"], "does not match the 8 available devices"),
        (["zero.strategy=optim_grads_params", "zero.path=flat", "zero.param_gather_dtype=int8"], "gathered in the"),
        (["data.kind=text", "model.vocab_size=100"], "model.vocab_size=100 must be >= 256"),
        (["data.path=/nonexistent/dir"], "data.path='/nonexistent/dir' is not a directory"),
        (["data.kind=indexed"], "data.kind=indexed needs data.path"),
        (["data.kind=indexed", "data.path=/no/corpus"], "/no/corpus.idx does not exist"),
        (["data.kind=indexed", f"data.path={ROOT}/tests/data/megatron_uint16"], "holds token id 65535 but model.vocab"),
        (["data.kind=tokens", "data.path=/no/train.bin"], "data.path='/no/train.bin' does not exist"),
        (["data.val_fraction=1"], "data.val_fraction=1.0 must be in [0, 1)"),
        (["train.eval_every=-1"], "train.eval_every=-1 must be >= 0"),
        (["optimizer.lr=-1"], "optimizer.lr=-1.0 must be positive"),
        (["optimizer.param_groups=[{pattern: '('}]"], "optimizer.param_groups[0].pattern='(' is not a regular"),
        (["optimizer.param_groups=[{lr_mult: 2}]"], "optimizer.param_groups[0].pattern is required"),
        (["optimizer.param_groups=[{pattern: a, lr_mult: -1}]"], "optimizer.param_groups[0].lr_mult=-1.0 must be >= 0"),
        (["optimizer.name=sgd", "optimizer.param_groups=[{pattern: a, wd_mult: 0}]"], "sgd has no weight decay"),
        (["optimizer.muon.scale_mode=rms"], "optimizer.muon.scale_mode='rms' is not one of"),
        (["optimizer.muon.steps=5"], "unknown config key optimizer.muon.steps"),
        (["optimizer.name=muon", "optimizer.muon.ns_steps=0"], "optimizer.muon.ns_steps=0 must be positive"),
        (["optimizer.name=muon", "optimizer.muon.momentum=1"], "optimizer.muon.momentum=1.0 must be in [0, 1)"),
        (["optimizer.name=muon", "zero.path=flat"], "optimizer.name=muon cannot run on zero.path=flat"),
        (["optimizer.name=optax"], "optimizer.name=optax needs optimizer.optax.name: an optax optimizer"),
        (["optimizer.optax.name=lion"], "optimizer.optax is set but optimizer.name=adamw"),
        (["optimizer.name=optax", "optimizer.optax.name=lionx"], "optimizer.optax.name='lionx': module optax has no"),
        (["optimizer.name=optax", "optimizer.optax.name=optax.tree_utils"], "is a module, not a function returning"),
        (["optimizer.name=optax", "optimizer.optax.name=nope.mod:f"], "optimizer.optax.name='nope.mod:f': cannot"),
        (["optimizer.name=optax", "optimizer.optax.name=lion", "optimizer.optax.args.momentum=0.9"],
         "optimizer.optax.args.momentum: lion takes no momentum (it takes: b1, b2, mu_dtype, weight_decay, mask)"),
        (["optimizer.name=optax", "optimizer.optax.name=lion", "optimizer.optax.args.learning_rate=1"],
         "optimizer.optax.args.learning_rate: the learning rate is the run's schedule"),
        (["optimizer.name=optax", "optimizer.optax.name=optax.contrib.schedule_free"],
         "optimizer.optax.args.base_optimizer is required"),
        (["optimizer.name=optax", "optimizer.optax.name=lion", "optimizer.param_groups=[{pattern: a, wd_mult: 0}]"],
         "optimizer.param_groups[0].wd_mult: optimizer.name=optax decays by its own args"),
        (["optimizer.name=optax", "optimizer.optax.name=lion", "optimizer.moments_dtype=bfloat16"],
         "optimizer.moments_dtype=bfloat16 with optimizer.optax.args.b2=0.99"),
        (["model.moe.num_experts=6", "mesh.ep=4"], "model.moe.num_experts=6 must be divisible by mesh.ep=4"),
        (["model.moe.num_experts=4", "model.moe.top_k=5"], "model.moe.top_k=5 must be in [1, model.moe.num_experts=4]"),
        (["model.moe.num_experts=4", "model.moe.capacity_factor=nan"], "model.moe.capacity_factor=nan must be"),
    ],
)
def test_bad_input_is_one_clear_line(overrides, needle, capsys, tmp_path):
    argv = ["train", "--out", str(tmp_path), "--quiet"]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_missing_config_file(capsys):
    assert main(["train", "/no/such.yaml"]) == 2
    assert "config file /no/such.yaml does not exist" in capsys.readouterr().err


def test_a_preset_is_a_config_by_name(capsys):
    """`jzero train llama2_7b`: a name with no directory and no suffix is the preset of configs/ (package data
    of an install: tests/test_packaging.py); an unknown one lists them."""
    assert load_config("llama2_7b") == load_config(ROOT / "configs" / "llama2_7b.yaml")
    assert load_config("default") == Config()
    assert main(["train", "llama9"]) == 2
    assert f"config llama9 is no file and no preset (presets: {', '.join(presets())})" in capsys.readouterr().err


def test_cli_process_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "jzero.cli", "train", "--set", "model.n_heads=3"],
        capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=120,
    )
    assert proc.returncode == 2
    assert "model.d_model=128 must be divisible by model.n_heads=3" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--out"], "argument --out: expected one argument (usage: jzero train -h)"),
        (["ckpt"], "the following arguments are required: ckpt_command (usage: jzero ckpt -h)"),
        (["hlo", "--network-gbs", "fast"],
         "argument --network-gbs: 'fast' is not a positive number (usage: jzero hlo -h)"),
        (["launch", "--local", "2", "--bogus"], "unrecognized arguments: --bogus (usage: jzero train -h)"),
    ],
)
def test_a_bad_option_is_one_line(argv, message, capsys):
    """Before, argparse's usage block (five lines for `train`) came before its error."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert (e.value.code, capsys.readouterr().err) == (2, f"jzero: error: {message}\n")


STAMP = "20250102-030405"


@pytest.fixture
def same_second(tmp_path, monkeypatch):
    """In a fresh working directory, every `time.strftime` answers the same second."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.time, "strftime", lambda fmt, *t: STAMP)
    return tmp_path


def test_default_out_dirs_claimed_in_the_same_second_differ(same_second):
    """Before, both runs wrote into runs/<timestamp> and into each other's metrics.jsonl."""
    first, second = cli._claim_run_dir(), cli._claim_run_dir()
    assert (first, second) == (Path("runs", STAMP), Path("runs", f"{STAMP}-1"))
    assert first.is_dir() and second.is_dir()
    assert sorted(p.name for p in (same_second / "runs").iterdir()) == [STAMP, f"{STAMP}-1"]


def test_default_out_dir_skips_a_file_named_like_its_timestamp(same_second):
    (same_second / "runs").mkdir()
    (same_second / "runs" / STAMP).write_text("theirs")
    assert cli._claim_run_dir() == Path("runs", f"{STAMP}-1")
    assert (same_second / "runs" / STAMP).read_text() == "theirs"
    with pytest.raises(ConfigError, match=f"{STAMP}-1 .. -1 all exist already; choose --out"):
        cli._claim_run_dir(tries=2)


@pytest.mark.parametrize(
    "argv, claimed",
    [
        (["--set", "model.n_heads=3"], None),  # a bad config leaves nothing behind
        (["--process-id", "0"], None),  # nor do bad multi-process flags
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"], []),  # process 0 claims
        (["--distributed"], []),  # its process number is known once JAX has joined: process 0 claims then
        ([], [STAMP]),  # input checked: claimed just before JAX starts
    ],
)
def test_default_out_dir_is_claimed_only_once_the_input_is_checked(argv, claimed, same_second, capsys, monkeypatch):
    """`claimed`: what runs/ holds when JAX would start (None: it is not reached). A run that fails before
    writing anything removes the directory it claimed: runs/ ends with nothing in it."""
    seen = []

    def start(*_):
        runs = same_second / "runs"
        seen.append(sorted(p.name for p in runs.iterdir()) if runs.exists() else [])
        raise ConfigError("stopped where JAX would start")

    monkeypatch.setattr(cli, "_start", start)
    assert main(["train", "--quiet", *argv]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert seen == ([] if claimed is None else [claimed])
    runs = same_second / "runs"
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.slow
def test_train_writes_metrics_and_summary(tmp_path, capsys):
    argv = ["train", "--out", str(tmp_path), "--quiet"]
    argv += ["--set", "train.steps=4", "--set", "mesh.dp=4", "--set", "mesh.tp=2"]
    assert main(argv + TINY) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"} <= set(r)
    assert [r["step"] for r in rows if "val_loss" in r] == [4]  # the default text's held-out 3%, at the last step
    summary = json.loads((tmp_path / "summary.json").read_text())
    b = summary["bytes_per_device"]
    assert b["measured"]["optimizer_state"] < b["ddp"]["optimizer_state"]
    assert (summary["val_loss_last"], summary["val_loss_step"]) == (rows[-1]["val_loss"], 4)
    out = capsys.readouterr().out
    assert "per-device memory" in out and "Megatron formula" in out
    assert f"validation loss {rows[-1]['val_loss']:.4f} at step 4" in out


@pytest.mark.parametrize("path", ["spec", "owned"])
@pytest.mark.slow
def test_muon_trains(tmp_path, path):
    """`optimizer.name: muon` (Megatron's Muon for the matrices, AdamW for the rest) trains the tiny GPT, on the
    spec layout and on the owned one (each matrix stepped whole by its owner)."""
    argv = ["train", "--out", str(tmp_path), "--quiet", "--set", "train.steps=6", "--set", "data.kind=synthetic"]
    argv += ["--set", "optimizer.name=muon", "--set", "optimizer.lr=1e-2", "--set", "optimizer.warmup_steps=0"]
    argv += ["--set", f"zero.path={path}", "--set", "zero.strategy=optim"]
    assert main(argv + TINY) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses


def test_layout_of_the_owned_path_names_every_owner(capsys):
    """`jzero layout` with zero.path=owned: each rank's elements and the params (or layers) it owns whole."""
    assert main(["layout", "--set", "zero.path=owned", "--set", "zero.strategy=optim", *TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("domain dp_outerxdpxep (8 owners") and "rank 7:" in out and "tok_emb" in out


@pytest.mark.slow
def test_moe_one_liner_reports_its_routing(tmp_path, capsys):
    """README's MoE run (shortened): metrics gain aux_loss and dropped_frac, the summary a MoE line."""
    argv = ["train", "--out", str(tmp_path), "--quiet", "--set", "train.steps=3", "--set", "data.kind=synthetic"]
    argv += ["--set", "model.moe.num_experts=4", "--set", "mesh.ep=2"]
    assert main(argv + TINY) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all({"aux_loss", "dropped_frac"} <= set(r) for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mesh"]["ep"] == 2 and 0 <= summary["moe"]["dropped_frac_mean"] < 1
    assert "MoE: load-balancing loss" in capsys.readouterr().out


@pytest.mark.parametrize("path", ["spec"])  # the step's guard on every layout: tests/zero/common/test_update.py
def test_a_nonfinite_grad_norm_stops_the_run_before_its_update(tmp_path, capsys, path):
    """A run driven to overflow (lr 1e30, no clipping) stops at the first inf/nan grad norm in one line naming the
    step and the newest checkpoint; the update it would have applied was skipped, so the last good checkpoint and
    every metrics.jsonl line stay readable as strict JSON."""
    ckpt = tmp_path / "ckpt"
    argv = ["train", "--out", str(tmp_path), "--quiet", "--set", "train.steps=8", "--set", "data.kind=synthetic"]
    argv += ["--set", "optimizer.lr=1e30", "--set", "optimizer.warmup_steps=0", "--set", "optimizer.clip_grad=null"]
    argv += ["--set", f"zero.path={path}", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=1"]
    argv += ["--set", "checkpoint.async=false"]
    assert main(argv + TINY) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=pytest.fail) for line in lines]
    bad = rows[-1]["step"]
    assert rows[-1]["grad_norm"] is None and rows[-1]["nonfinite"]["grad_norm"] in ("nan", "inf")
    assert rows[-1]["skipped"] == 1.0 and 1 < bad < 8
    assert "grad norm is " in err and f"at step {bad}: its update was skipped and the run stopped" in err
    assert err.endswith(f"the newest checkpoint is step {bad - 1}")
    assert sorted(p.name for p in ckpt.glob("step_*"))[-1] == f"step_{bad - 1:08d}"  # the bad step saved nothing
