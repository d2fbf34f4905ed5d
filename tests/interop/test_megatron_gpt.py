"""jzero's GPT under Megatron's names (`jzero.interop.gpt`), against Megatron-Core 0.16.1's own GPTModel
(tests/data/megatron/gpt, written by its make_gpt_fixtures.py): the state-dict keys and their order,
Megatron's logits from jzero's forward on the converted weights, a checkpoint Megatron trained (legacy
and torch_dist, whose layers are stacked) into jzero, and the CLI both ways.

The logits: jzero's forward and Megatron's compute the same function in float32 with different
summation orders (matmuls, softmax, norms); on these 16-wide models they agree to 4.1e-7 (LLaMA-style)
and 3.5e-7 (GPT-2-style) of the largest logit, measured, and to 4.2e-7 on wider ones checked outside
the tests. The bound is 2e-6 of it; a wrong QKV interleave, gate/up order or transpose moves logits
by their own size.
"""

from __future__ import annotations

import json
import os
import threading
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.megatron_fixtures import DATA
from jzero.cli import main
from jzero.config import from_dict
from jzero.interop import InteropError, megatron, torch_format
from jzero.interop.gpt import gpt_names, megatron_names
from jzero.train.model import GPTModel

GPT = DATA / "gpt"
LLAMA = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, seq_len=8, tie_embeddings=False,
             mlp="swiglu", norm="rmsnorm", bias=False, pos="rope")  # fmt: skip
GPT2 = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=4, d_ff=24, seq_len=8, tie_embeddings=True, mlp="gelu",
            norm="layernorm", bias=True, pos="learned")  # fmt: skip
LOGITS_REL = 2e-6  # of the largest logit (module docstring)
LEGACY_MODEL = "ckpt_legacy/iter_0000002/mp_rank_00/model_optim_rng.pt"


def model_config(model: dict, **extra):
    return from_dict({"model": {**model, **extra}, "data": {"kind": "synthetic"}}).model


def leaves(names):
    return jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, megatron.Renamed))


def jzero_params(cfg, state: dict) -> dict:
    """jzero's params from Megatron's state dict (the model's weights only)."""
    model = GPTModel(cfg)
    abstract = model.abstract_params()
    names, _ = gpt_names(abstract, megatron_names(cfg))
    params = [r.from_megatron(tuple(state[n] for n in r.names)) for r in leaves(names)]
    return jax.tree.unflatten(jax.tree.structure(abstract), params)


def assert_logits(cfg, params, expected):
    logits, _, _ = nnx.merge(GPTModel(cfg).graphdef, params)(jnp.asarray(expected["tokens"][:, :-1]))
    want = expected["logits"]
    err = float(np.abs(np.asarray(logits) - want).max()) / float(np.abs(want).max())
    assert err <= LOGITS_REL, f"logits differ by {err:.3g} of the largest"


@pytest.mark.parametrize("kind, model, path", [("llama", LLAMA, LEGACY_MODEL), ("gpt2", GPT2, "model.pt")])
def test_megatrons_gpt_names_order_and_logits(kind, model, path):
    """megatron_names is GPTModel's state dict, key for key and in order (`_extra_state` entries and the
    QKV bias jzero's model has not included), and jzero's forward on the converted weights gives
    Megatron's logits."""
    cfg = model_config(model)
    state = torch_format.load(GPT / kind / path)
    state = state["model"] if "model" in state else state
    assert list(megatron_names(cfg)) == list(state)
    with np.load(GPT / kind / "expected.npz") as f:
        expected = {k: f[k] for k in f.files}
    assert_logits(cfg, jzero_params(cfg, state), expected)


@pytest.mark.parametrize(
    "model",
    [
        LLAMA,
        GPT2,
        {**LLAMA, "scan_layers": True, "bias": True, "norm": "layernorm", "pos": "learned", "tie_embeddings": True},
        {**GPT2, "n_kv_heads": 1, "bias": False, "n_layers": 3, "scan_layers": True},
    ],
)
def test_conversion_is_exact_both_ways(model):
    """Random params -> Megatron's arrays -> params, bit for bit; Megatron's shapes; a QKV row is the query
    head, key or value of its group that Megatron's layout says."""
    cfg = model_config(model)
    abstract = GPTModel(cfg).abstract_params()
    names, order = gpt_names(abstract, megatron_names(cfg))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), abstract)
    out: dict[str, np.ndarray] = {}
    for r, x in zip(leaves(names), jax.tree.leaves(params)):
        arrays = r.to_megatron(x)
        out |= dict(zip(r.names, arrays))
        np.testing.assert_array_equal(r.from_megatron(arrays), x)
    assert sorted(out) == sorted(k for k in order if not k.endswith(megatron.EXTRA_STATE))
    d, h, k, f = cfg.d_model, cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.d_ff
    g = cfg.n_kv_heads or h
    layer = (lambda x: x[0]) if cfg.scan_layers else (lambda x: x)
    blocks = params["blocks"] if cfg.scan_layers else params["blocks"][0]
    qkv = out["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((h + 2 * g) * k, d)
    kernel = layer(blocks["attn"]["qkv"]["kernel"])  # [D, R + 2, G, K]
    r = h // g
    for group in range(g):
        rows = qkv[group * (r + 2) * k : (group + 1) * (r + 2) * k].reshape(r + 2, k, d)
        np.testing.assert_array_equal(rows[0], kernel[:, 0, group, :].T)  # the group's first query head
        np.testing.assert_array_equal(rows[r], kernel[:, r, group, :].T)  # its key
        np.testing.assert_array_equal(rows[r + 1], kernel[:, r + 1, group, :].T)  # its value
    fc1 = out["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == ((2 * f if cfg.mlp.value == "swiglu" else f), d)
    assert out["decoder.layers.0.self_attention.linear_proj.weight"].shape == (d, h * k)
    if cfg.bias:  # Megatron's QKV bias, which jzero's attention has not: zeros out, and refused unless zero
        assert not out["decoder.layers.0.self_attention.linear_qkv.bias"].any()
        r = next(x for x in leaves(names) if "decoder.layers.0.self_attention.linear_qkv.bias" in x.names)
        arrays = [out[n].copy() for n in r.names]
        arrays[r.names.index("decoder.layers.0.self_attention.linear_qkv.bias")][3] = 0.5
        with pytest.raises(InteropError, match="linear_qkv.bias is not zero.*model.qkv_bias=true"):
            r.from_megatron(tuple(arrays))


@pytest.mark.parametrize("fmt", ["ckpt_legacy", "ckpt_torch_dist"])
def test_megatron_trained_gpt_into_jzero(fmt):
    """Megatron's 2-step checkpoint (both formats; torch_dist stacks the layers and keeps the norms under
    TE's names) into jzero's GPT on the flat path: the params Megatron had, its logits, and both formats
    the same optimizer state bit for bit."""
    cfg = from_dict({"model": LLAMA, "data": {"kind": "synthetic"}, "train": {"global_batch": 8},
                     "zero": {"path": "flat", "strategy": "optim"}})  # fmt: skip
    from jzero.train.loop import setup

    run = setup(cfg, with_data=False)
    names, _ = gpt_names(run.model.abstract_params(), megatron_names(cfg.model))
    flat = [n for r in leaves(names) for n in r.names]
    ck = megatron.read(GPT / "llama" / fmt, bucket_size=2000, names=flat)
    other = megatron.read(GPT / "llama" / ("ckpt_legacy" if fmt != "ckpt_legacy" else "ckpt_torch_dist"),
                          bucket_size=2000, names=flat)  # fmt: skip
    assert ck.iteration == ck.adam_step == 2 and ck.bucket_numels == other.bucket_numels == (2304, 2048, 832)
    for key in ("model", "main", "exp_avg", "exp_avg_sq"):
        for name, x in getattr(ck, key).items():
            np.testing.assert_array_equal(x, getattr(other, key)[name], err_msg=f"{key} {name}")
    with np.load(GPT / "llama" / "expected.npz") as f:
        expected = {k: f[k] for k in f.files}
    for name, x in ck.model.items():
        np.testing.assert_array_equal(x, expected[f"param/{name}"])
    state = megatron.to_train_state(ck, run.zero, names)
    assert int(state.step) == 2
    assert_logits(cfg.model, jax.device_get(run.zero.full_params(state.params)), expected)


def _yaml(tmp_path: Path, model: dict) -> Path:
    path = tmp_path / "gpt.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "model": model, "data": {"kind": "synthetic"}, "zero": {"path": "flat", "strategy": "optim_grads"},
        "optimizer": {"lr": 0.01, "warmup_steps": 1, "b2": 0.95, "weight_decay": 0.1},
        "train": {"steps": 3, "global_batch": 8, "eval_every": 0},
    }))  # fmt: skip
    return path


@pytest.mark.slow
def test_cli_import_train_export(tmp_path, capsys):
    """Megatron's torch_dist checkpoint -> a jzero checkpoint -> Megatron's legacy format: the tensors of
    Megatron's own legacy file, bit for bit; then one jzero step on it, exported again, reads back."""
    config = _yaml(tmp_path, LLAMA)
    assert (
        main(["ckpt", "import-megatron", str(GPT / "llama" / "ckpt_torch_dist"), str(tmp_path / "j"), str(config)]) == 0
    )
    out = capsys.readouterr().out
    assert (
        "imported Megatron iteration 2" in out
        and "Adam's step count continues from the checkpoint's iteration, 2" in out
    )
    argv = ["ckpt", "export-megatron", str(tmp_path / "j"), str(tmp_path / "m"), str(config), "--bucket-size", "2000"]
    assert main(argv) == 0
    assert "--ckpt-format torch" in capsys.readouterr().out
    ours = tmp_path / "m" / "iter_0000002" / "mp_rank_00"
    theirs = GPT / "llama" / "ckpt_legacy" / "iter_0000002" / "mp_rank_00"
    a, b = (
        torch_format.load(ours / "model_optim_rng.pt")["model"],
        torch_format.load(theirs / "model_optim_rng.pt")["model"],
    )
    assert list(a) == list(b)
    for key, value in b.items():
        assert value is None and a[key] is None or np.array_equal(a[key], value), key
    a, b = torch_format.load(ours / "distrib_optim.pt")[0], torch_format.load(theirs / "distrib_optim.pt")[0]
    assert list(a) == list(b)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(next(iter(a.values()))[key], next(iter(b.values()))[key])
    assert main(["ckpt", "export-megatron", str(tmp_path / "j"), str(tmp_path / "m"), str(config)]) == 2
    assert "exists: jzero never overwrites" in capsys.readouterr().err

    assert main(["train", str(config), "--out", str(tmp_path / "run"), "--quiet", "--resume", str(tmp_path / "j"),
                 "--set", f"checkpoint.dir={tmp_path / 'j'}"]) == 0  # fmt: skip
    assert main(["ckpt", "export-megatron", str(tmp_path / "j"), str(tmp_path / "m"), str(config)]) == 2
    assert "latest_checkpointed_iteration.txt exists: jzero never overwrites" in capsys.readouterr().err
    assert main(["ckpt", "export-megatron", str(tmp_path / "j"), str(tmp_path / "m3"), str(config)]) == 0
    assert megatron.read(tmp_path / "m3").iteration == 3


@pytest.mark.parametrize(
    "argv, flags, needle",
    [
        (["import-megatron", "{gpt}/llama/ckpt_torch_dist"], ["--set", "model.d_ff=32"], "do not give the model"),
        (["import-megatron", "{tmp}/evil/iter_0000001"], [], "refers to posix.system, which jzero does not"),
        (["import-megatron", "{tmp}/nothing"], [], "does not exist"),
        (["import-megatron", "{gpt}/llama/ckpt_torch_dist"], ["--bucket-size", "0"], "--bucket-size 0"),
        (["import-megatron", "{gpt}/llama/ckpt_torch_dist"], ["--names", "{tmp}/names.json"], "names: "),
        (["import-megatron", "{gpt}/gpt2"], [], "is not a Megatron checkpoint"),
        (["export-megatron", "{tmp}"], [], "is not a jzero checkpoint directory"),
    ],
)
def test_cli_bad_input_is_one_line(argv, flags, needle, tmp_path, capsys):
    evil = tmp_path / "evil" / "iter_0000001" / "mp_rank_00"
    evil.mkdir(parents=True)
    with zipfile.ZipFile(evil / "model_optim_rng.pt", "w") as zf:  # a torch file whose pickle calls posix.system
        zf.writestr("model_optim_rng/data.pkl", b"cposix\nsystem\n(S'true'\ntR.")
    (tmp_path / "names.json").write_text(json.dumps({"embedding.word_embeddings.weight": "tok_emb"}))
    config = _yaml(tmp_path, LLAMA)
    argv = [a.format(gpt=GPT, tmp=tmp_path) for a in [*argv, "{tmp}/out", str(config), *flags]]
    assert main(["ckpt", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and err.startswith("jzero: error: "), err


@pytest.mark.parametrize(
    "existing, flags, refusal",
    [
        (megatron.TRACKER, [], "exists: jzero never overwrites a checkpoint's tracker; choose another directory"),
        ("iter_0000005", ["--step", "5"], "exists: jzero never overwrites a checkpoint; move it away or choose another "
         "OUT_DIR"),
    ],
)
def test_export_refuses_to_overwrite_before_restoring(existing, flags, refusal, tmp_path, capsys, monkeypatch):
    """Before, OUT_DIR's Megatron tracker was refused only after the (slow) restore of the jzero checkpoint; here
    the checkpoint does not even exist, and nothing is set up (no JAX, no run)."""
    from jzero.interop import commands

    out = tmp_path / "out"
    out.mkdir()
    (out / existing).write_text("100") if existing == megatron.TRACKER else (out / existing).mkdir()
    monkeypatch.setattr(commands, "_setup", lambda *a: pytest.fail("set up before refusing"))
    argv = ["ckpt", "export-megatron", str(tmp_path / "nothing"), str(out), str(_yaml(tmp_path, LLAMA)), *flags]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"jzero: error: {out / existing} {refusal}\n"
    assert [p.name for p in out.iterdir()] == [existing]
    assert existing != megatron.TRACKER or (out / existing).read_text() == "100"


@pytest.mark.parametrize("command", ["import-megatron", "export-megatron"])
@pytest.mark.parametrize("under", [False, True])
def test_an_out_dir_that_cannot_be_a_directory_is_refused_up_front(command, under, tmp_path, capsys, monkeypatch):
    """OUT_DIR a file, or under one: one line naming OUT_DIR, before the config, JAX and the read (an export's
    was FileExistsError or NotADirectoryError once the checkpoint was restored; an import's spoke of
    checkpoint.dir)."""
    from jzero.interop import commands

    (tmp_path / "file").write_text("mine")
    out = tmp_path / "file" / "sub" if under else tmp_path / "file"
    monkeypatch.setattr(commands, "_setup", lambda *a: pytest.fail("set up before refusing"))
    source = GPT / "llama" / "ckpt_legacy" if command == "import-megatron" else tmp_path / "nothing"
    assert main(["ckpt", command, str(source), str(out), str(_yaml(tmp_path, LLAMA))]) == 2
    what = f"OUT_DIR {out}: {tmp_path / 'file'}" if under else f"OUT_DIR {out}"
    assert capsys.readouterr().err == f"jzero: error: {what} is a file, not a directory\n"
    assert (tmp_path / "file").read_text() == "mine"


def test_import_refuses_bucket_size_for_torch_dist(tmp_path, capsys, monkeypatch):
    """--bucket-size is for the legacy format (its help says so): a torch_dist checkpoint records its buckets,
    and the flag was silently ignored there. Refused in one line, before the config and JAX; with the legacy
    format it goes on to the setup."""
    from jzero.config import ConfigError
    from jzero.interop import commands

    def setup(*a):
        raise ConfigError("set up")

    monkeypatch.setattr(commands, "_setup", setup)
    config = str(_yaml(tmp_path, LLAMA))
    argv = ["ckpt", "import-megatron", str(GPT / "llama" / "ckpt_torch_dist"), str(tmp_path / "j"), config]
    assert main([*argv, "--bucket-size", "100"]) == 2
    assert capsys.readouterr().err == (
        "jzero: error: --bucket-size 100 is for the legacy format, whose files do not record their buckets; "
        f"{GPT / 'llama' / 'ckpt_torch_dist'} is torch_dist, which does: drop --bucket-size\n"
    )
    argv[2] = str(GPT / "llama" / "ckpt_legacy")
    assert main([*argv, "--bucket-size", "100"]) == 2
    assert capsys.readouterr().err == "jzero: error: set up\n"
    assert not (tmp_path / "j").exists()


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path]:
    """(a jzero checkpoint directory holding step 2, imported from Megatron's LLaMA-style legacy files; its config)."""
    root = tmp_path_factory.mktemp("imported")
    config = _yaml(root, LLAMA)
    argv = ["ckpt", "import-megatron", str(GPT / "llama" / "ckpt_legacy"), str(root / "j"), str(config)]
    assert main(argv) == 0
    return root / "j", config


def test_import_into_a_taken_directory_speaks_of_out_dir(imported, tmp_path, capsys):
    """Into a jzero checkpoint directory with steps, or a directory jzero did not make: one line naming OUT_DIR,
    the import's own argument (before: `jzero train`'s checkpoint.dir and --resume, which it has not)."""
    j, config = imported
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for out, says in (
        (j, f"OUT_DIR {j} is a jzero checkpoint directory holding steps 2: an import writes a new one; give a new "
            "or empty OUT_DIR"),
        (foreign, f"OUT_DIR {foreign} is not empty (1 entries: notes.txt)"),
    ):  # fmt: skip
        before = sorted(p.name for p in out.iterdir())
        assert main(["ckpt", "import-megatron", str(GPT / "llama" / "ckpt_legacy"), str(out), str(config)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jzero: error: {says}") and err.count("\n") == 1, err
        assert "checkpoint.dir" not in err and "--resume" not in err, err
        assert sorted(p.name for p in out.iterdir()) == before


def test_export_of_a_damaged_newest_step_names_step(imported, tmp_path, capsys):
    """A damaged newest step: the export's own --step and the steps it could take (before: train's
    --resume-fallback, which export has not)."""
    import shutil

    j, config = imported
    ck = tmp_path / "ck"
    shutil.copytree(j, ck, ignore=shutil.ignore_patterns("jzero.lock"))
    shutil.copytree(ck / "step_00000002", ck / "step_00000001")
    meta = ck / "step_00000002" / "meta" / "metadata"
    meta.write_text(meta.read_text()[:20])
    assert main(["ckpt", "export-megatron", str(ck), str(tmp_path / "m"), str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jzero: error: checkpoint step 2 in {ck}") and err.count("\n") == 1, err
    assert err.endswith("; export another of its steps with --step N (1)\n") and "--resume" not in err, err
    assert not (tmp_path / "m").exists()


def test_a_fifo_as_the_names_file_is_refused_not_read(tmp_path, capsys):
    """Reading a named pipe blocks until something writes to it: forever."""
    os.mkfifo(tmp_path / "names.fifo")
    argv = ["ckpt", "import-megatron", str(GPT / "llama" / "ckpt_torch_dist"), str(tmp_path / "out"),
            str(_yaml(tmp_path, LLAMA)), "--names", str(tmp_path / "names.fifo")]  # fmt: skip
    codes = []
    thread = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "reading the FIFO blocked"
    assert codes == [2]
    err = capsys.readouterr().err.strip()
    assert err == f"jzero: error: names file {tmp_path / 'names.fifo'} is not a regular file", err


def test_exported_flags_name_megatrons_gelu():
    """Megatron-LM's GPT computes the exact GELU whatever --openai-gelu says: a `gelu_exact` model exports
    with no GELU flag (Megatron's default), swiglu with --swiglu, and nothing claims --openai-gelu; a tanh
    `gelu` model's moves carry a note that the function changes (`TANH_GELU_NOTE`)."""
    from jzero.interop.commands import TANH_GELU_NOTE, megatron_flags

    for model in ({**GPT2, "mlp": "gelu_exact"}, GPT2):
        flags = megatron_flags(from_dict({"model": model, "data": {"kind": "synthetic"}}), None, "out")
        assert "gelu" not in flags and "--swiglu" not in flags
    assert "--swiglu" in megatron_flags(from_dict({"model": LLAMA, "data": {"kind": "synthetic"}}), None, "out")
    assert "model.mlp=gelu_exact" in TANH_GELU_NOTE and "exact (erf) GELU" in TANH_GELU_NOTE


def test_qkv_bias_moves_as_the_kernels_rows():
    """With `model.qkv_bias` Megatron's linear_qkv.bias [G (R + 2) K] is attn/qkv/bias [R + 2, G, K], row for
    row as the kernel (y = W x + b the same output in both layouts); both ways exact."""
    cfg = from_dict({"model": {**GPT2, "n_kv_heads": 2, "qkv_bias": True}, "data": {"kind": "synthetic"}}).model
    model = GPTModel(cfg)
    params = jax.tree.map(lambda x: np.random.default_rng(x.size).standard_normal(x.shape).astype(np.float32),
                          model.init())  # fmt: skip
    tree, _ = gpt_names(jax.eval_shape(model.init), megatron_names(cfg))
    renamed = tree["blocks"][0]["attn"]["qkv"]
    (w,) = renamed["kernel"].to_megatron(params["blocks"][0]["attn"]["qkv"]["kernel"])
    (b,) = renamed["bias"].to_megatron(params["blocks"][0]["attn"]["qkv"]["bias"])
    assert renamed["bias"].names == ("decoder.layers.0.self_attention.linear_qkv.bias",)
    x = np.random.default_rng(0).standard_normal(cfg.d_model).astype(np.float32)
    ours = (
        np.einsum("d,dsgk->sgk", x, params["blocks"][0]["attn"]["qkv"]["kernel"])
        + params["blocks"][0]["attn"]["qkv"]["bias"]
    )
    theirs = renamed["bias"].from_megatron((w @ x + b,))
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(renamed["bias"].from_megatron((b,)), params["blocks"][0]["attn"]["qkv"]["bias"])
