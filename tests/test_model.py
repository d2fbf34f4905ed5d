"""A model of one's own: `model.impl: helpers.toy_model:ToyModel` (tests/helpers/toy_model.py, no change in jzero/)
trains under `jzero train` and is compiled and reported by `jzero hlo` and `jzero memory`; one that declares
its own `model:` keys (`config_class`) gets them typed, from YAML and `--set`, and its checkpoints record them;
a bad `model.impl` or key is one line; the inspect tools import nothing from the harness."""

import ast
import json
import math
from pathlib import Path

import jax
import jaxlib
import pytest

from helpers.toy_model import Activation, ToyConfig, ToyModel, ToyModelWithOwnKeys
from jzero.cli import main
from jzero.config import from_dict, load_config, to_dict
from jzero.errors import ConfigError
from jzero.inspect.comms.records import HloReport
from jzero.model import REQUIRED, Model, make_model
from jzero.train.ckpt_step import read_meta
from jzero.train.model import GPTModel
from jzero.zero.build import xla_crashes_on_empty_params

ROOT = Path(__file__).resolve().parents[1]
V, D, F = 256, 32, 64
TOY = ["model.impl=helpers.toy_model:ToyModel", "model.seq_len=16", f"model.d_model={D}", f"model.d_ff={F}",
       "data.kind=synthetic"]  # fmt: skip
N_PARAMS = V * D + D * F + F * D + D + D * V
OWN = ["model.impl=helpers.toy_model:ToyModelWithOwnKeys", "model.seq_len=16", "data.kind=synthetic"]


def sets(overrides) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def test_gpt_and_the_toy_model_implement_the_protocol():
    cfg = load_config(None, TOY)
    assert isinstance(ToyModel(cfg.model), Model) and isinstance(GPTModel(load_config().model), Model)
    assert set(REQUIRED) == {"init", "abstract_params", "loss_and_metrics", "tp_specs", "units", "is_expert",
                             "layer_ndims"}  # fmt: skip


def test_gpt_only_checks_leave_another_model_alone():
    """model.d_model=32 with n_heads=3 is no GPT, but the toy model reads neither key."""
    assert load_config(None, [*TOY, "model.n_heads=3"]).model.n_heads == 3
    with pytest.raises(ConfigError, match="model.d_model=32 must be divisible by model.n_heads=3"):
        load_config(None, [*TOY[1:], "model.n_heads=3"])


def test_jzero_train_trains_the_toy_model(tmp_path, capsys):
    """Flat path, tp=2: the toy's row-parallel MLP is summed over tp_axis; its metric reaches the rows."""
    over = [*TOY, "train.steps=8", "mesh.dp=4", "mesh.tp=2", "zero.path=flat", "optimizer.lr=0.05",
            "optimizer.warmup_steps=1"]
    assert main(["train", "--out", str(tmp_path), "--quiet", *sets(over)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)) and all("accuracy" in r for r in rows)
    assert rows[0]["loss"] == pytest.approx(math.log(V), abs=0.05)  # small init: uniform predictions
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, [r["loss"] for r in rows]
    assert "per-device memory" in capsys.readouterr().out


@pytest.mark.parametrize("path", ["spec", "flat"])
@pytest.mark.slow
def test_a_loss_reading_unit_params_outside_unit_is_one_line(path, tmp_path, capsys):
    """`jzero train` on a model whose loss adds a penalty over all params, its MLP a unit: exit 2, one line
    naming the param (`unit_check.check_loss`), before any step."""
    over = ["model.impl=helpers.penalized_model:PenalizedToyModel", *TOY[1:], "train.steps=1", f"zero.path={path}"]
    assert main(["train", "--out", str(tmp_path), "--quiet", *sets(over)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the loss reads unit param 'fc1' outside `unit`" in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_jzero_hlo_and_memory_report_the_toy_model(tmp_path, capsys):
    """No units (P_unit 0, ZeRO-3 gathers every param up front), no experts, no tokens' exchange,
    no attention buffers; DDP's all-reduce is the theory's."""
    strategies = ["--strategies", "no_shard,optim_grads_params"]
    assert main(["hlo", *strategies, "--json", str(tmp_path / "hlo.json"), *sets(TOY)]) == 0
    text = capsys.readouterr().out
    doc = json.loads((tmp_path / "hlo.json").read_text())
    assert HloReport.from_json(doc).to_json() == doc
    assert (doc["params"], doc["expert_params"], doc["edp"]) == (N_PARAMS, 0, None)
    assert doc["config"]["model"]["impl"] == "helpers.toy_model:ToyModel"
    for s in doc["strategies"].values():
        assert s["tokens"] is None and s["theory"]["unit_param_bytes"] == 0
        assert s["peak"]["by_category"]["attention"] == 0
    assert doc["strategies"]["no_shard"]["ratio"] == pytest.approx(1.0, rel=1e-3)
    assert [t["what"] for t in doc["strategies"]["optim_grads_params"]["theory"]["domains"]["dense"]["terms"]] == [
        "grads", "params"]  # fmt: skip
    assert "P_unit = 0 B" in text and "tokens (not DP)" not in text

    assert main(["memory", *strategies, "--json", str(tmp_path / "memory.json"), *sets(TOY)]) == 0
    mem = json.loads((tmp_path / "memory.json").read_text())
    ddp, z3 = mem["strategies"]["no_shard"], mem["strategies"]["optim_grads_params"]
    assert ddp["state"]["params"] == 4 * N_PARAMS and z3["state"]["params"] == 4 * N_PARAMS // 8
    for s in (ddp, z3):
        for part in ("params", "main_params", "grads"):
            assert s["state"][part] == s["formula"][part], part
        assert 0 <= s["state"]["optimizer_moments"] - s["formula"]["optimizer_moments"] <= 16  # Adam's counters


@pytest.mark.slow
def test_a_model_with_a_zero_size_param_checkpoints_and_resumes(tmp_path, capsys):
    """orbax saves no 0-size array; the checkpoint leaves `prefix[0, D]` out of its arrays, lists it, and
    makes it again on restore: a run resumed at step 2 takes step 3 as the straight run does. Where
    jaxlib's XLA would crash on the param, the run stops with one line and exit code 2 instead."""
    over = ["model.impl=helpers.empty_param_model:EmptyParamToyModel", *TOY[1:], f"checkpoint.dir={tmp_path / 'ck'}"]
    if xla_crashes_on_empty_params(jaxlib.__version__):
        assert main(["train", "--out", str(tmp_path / "a"), "--quiet", *sets([*over, "train.steps=2"])]) == 2
        assert "has shape (0, 32), 0 elements" in capsys.readouterr().err
        return
    assert main(["train", "--out", str(tmp_path / "a"), "--quiet", *sets([*over, "train.steps=2"])]) == 0
    assert main(["train", "--out", str(tmp_path / "b"), "--quiet", "--resume", *sets([*over, "train.steps=3"])]) == 0
    straight = [*over[:-1], "train.steps=3"]
    assert main(["train", "--out", str(tmp_path / "c"), "--quiet", *sets(straight)]) == 0
    resumed, straight = ([json.loads(r) for r in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                         for d in "bc")  # fmt: skip
    assert [r["step"] for r in resumed] == [3] and resumed[0]["loss"] == straight[-1]["loss"], (resumed, straight)
    capsys.readouterr()
    assert main(["ckpt", "info", str(tmp_path / "ck"), "--verify"]) == 0
    info = capsys.readouterr().out
    assert "params/prefix" in info and "(0, 32)" in info and "step 2: verified" in info, info


def test_a_model_with_its_own_keys_gets_them_typed():
    """`config_class = ToyConfig`: the section's keys but impl, vocab_size and seq_len are its, typed (an enum
    too), `--set` overriding them; the class is built from that ToyConfig; `to_dict` writes the keys where
    `from_dict` reads them back (a checkpoint's config)."""
    cfg = load_config(None, [*OWN, "model.d_ff=48", "model.activation=relu", "model.vocab_size=300"])
    assert cfg.model.own == ToyConfig(vocab_size=300, d_model=32, d_ff=48, activation=Activation.RELU)
    assert (cfg.model.vocab_size, cfg.model.seq_len) == (300, 16)  # the harness's keys, vocab_size shared
    model = make_model(cfg)
    assert isinstance(model, ToyModelWithOwnKeys) and (model.f, model.vocab) == (48, 300)
    assert model.act is jax.nn.relu
    section = to_dict(cfg)["model"]
    assert section == {"impl": "helpers.toy_model:ToyModelWithOwnKeys", "vocab_size": 300, "seq_len": 16,
                       "d_model": 32, "d_ff": 48, "activation": "relu"}  # fmt: skip
    assert from_dict(to_dict(cfg)) == cfg
    assert load_config(None, OWN).model.vocab_size == ToyConfig.vocab_size  # the class's default is the run's


def test_jzero_train_gives_a_model_its_own_keys(tmp_path, capsys):
    """`--set model.d_ff=48`, a key only the model declares, reaches it (its fc1 is [32, 48] in the checkpoint)
    and the checkpoint's config holds it."""
    over = [*OWN, "model.d_ff=48", "train.steps=2", "mesh.dp=8", f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.async=false"]  # fmt: skip
    assert main(["train", "--out", str(tmp_path / "out"), "--quiet", *sets(over)]) == 0
    meta = read_meta(tmp_path / "ck", 2)
    assert meta["arrays"]["params/fc1"]["shape"] == [D, 48]
    assert meta["config"]["model"]["d_ff"] == 48 and "n_heads" not in meta["config"]["model"]
    assert from_dict(meta["config"]).model.own.d_ff == 48


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.n_heads=4"], "unknown config key model.n_heads (known: activation, d_ff, d_model, impl, seq_len, "),
        (["model.d_ff=wide"], "model.d_ff='wide' must be of type int"),
        (["model.activation=tanh"], "model.activation='tanh' is not one of: gelu, relu"),
        (["model.seq_len=0"], "model.seq_len=0 must be positive"),
        (
            ["model.impl=helpers.toy_model:ToyModelWithAMutableConfig"],
            "its config_class <class 'helpers.toy_model.MutableConfig'> must be a frozen dataclass",
        ),
    ],
)
def test_a_bad_key_of_a_model_s_own_is_one_line(overrides, needle, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--quiet", *sets([*OWN, *overrides])]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "impl, needle",
    [
        ("toy_model", "model.impl='toy_model' must look like package.module:Class"),
        ("no_such_module:Model", "model.impl='no_such_module:Model': cannot import no_such_module"),
        ("helpers.toy_model:Nope", "model.impl='helpers.toy_model:Nope': module helpers.toy_model has no Nope"),
        ("json:JSONDecoder", "JSONDecoder has no init, abstract_params, loss_and_metrics, tp_specs"),
        (
            "helpers.toy_model:ToyModelWithoutDpAxes",
            "ToyModelWithoutDpAxes.__init__ takes no dp_axes; jzero builds the model as "
            "ToyModelWithoutDpAxes(cfg.model, param_dtype=, seed=, dp_axes=)",
        ),
    ],
)
def test_bad_model_impl_is_one_line(impl, needle, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--quiet", *sets([*TOY, f"model.impl={impl}"])]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def _jzero_imports(path: Path) -> set[str]:
    """The jzero modules `path` imports (at any depth of the file: lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jzero"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jzero")}
    return out


@pytest.mark.parametrize(
    "where, forbidden",
    [
        ("jzero/inspect", ("jzero.train",)),
        ("jzero/zero", ("jzero.train", "jzero.inspect", "jzero.run", "jzero.model", "jzero.cli")),
        ("jzero/model.py", ("jzero.train", "jzero.inspect", "jzero.run", "jzero.cli")),
        ("jzero/run.py", ("jzero.train", "jzero.inspect", "jzero.cli")),
        ("jzero/optim.py", ("jzero.train", "jzero.inspect", "jzero.run", "jzero.cli")),
    ],
)
def test_imports_run_downward(where, forbidden):
    """cli -> train / inspect -> run -> model, optim -> zero -> mesh, config, errors; inspect never imports
    train (a model's class is named by model.impl, not imported)."""
    path = ROOT / where
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    bad = {
        f"{f.relative_to(ROOT)}: {m}"
        for f in files
        for m in _jzero_imports(f)
        if any(m == name or m.startswith(name + ".") for name in forbidden)
    }
    assert not bad
