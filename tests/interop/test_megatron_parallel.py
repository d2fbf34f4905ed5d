"""Megatron-Core 0.16.1's tensor-, pipeline- and expert-parallel checkpoints into jzero
(tests/data/megatron/gpt/tp2pp2 and moe_ep2, written by make_parallel_fixtures.py; their README section
"Tensor/pipeline-parallel and MoE GPTs"): TP 2 x PP 2 GPTs (untied, and tied with the last stage's copy
of the embedding) and an EP 2 MoE GPT, in the legacy format and torch_dist's dp_reshardable and
fully_reshardable. Each checkpoint reads to the whole model Megatron's own joined arrays hold
(`expected.npz`), bit for bit: weights, fp32 main params and Adam's moments; lands on jzero meshes of
other shapes (dp 8; dp 2 x tp 2 x ...; the MoE on dp 4 x ep 2) on both the spec and the flat path; and
continues Megatron's steps 11..15.

Tolerances: as tests/interop/test_megatron.py's, 1e-6 of each compared quantity's magnitude (losses and
grad norms relative, params of each tensor's largest value): jzero and Megatron compute the same float32
arithmetic in different orders (XLA's reductions against torch's CPU kernels, optax's AdamW against
torch's; test_megatron.py's docstring). Measured here over steps 11..15, the largest over 12 meshes, paths
and formats (2026-11-27; 7 run now): losses 2.4e-7 relative, grad norms 1.9e-7, step-15 params 4.1e-7 of each
tensor's largest value
(the running maxima are kept in `MEASURED`). A wrong join (a TP slice, a gate/up half, a layer offset,
an expert) moves a value by its own size.
"""

from __future__ import annotations

import functools
import json
import shutil

import jax
import numpy as np
import pytest

from helpers import megatron_fixtures as fixtures
from jzero.config import from_dict
from jzero.interop import InteropError, megatron, torch_format
from jzero.interop.gpt import gpt_names, megatron_names

DATA = fixtures.DATA
CLIP = fixtures.PARALLEL_CLIP
GLOBAL_BATCH = fixtures.PARALLEL_GLOBAL_BATCH
MODELS = fixtures.PARALLEL_MODELS
STEP = fixtures.PARALLEL_STEP

GPT = DATA / "gpt"
REL = 1e-6
FORMATS = {
    "legacy": "ckpt_legacy",
    "dp_reshardable": "ckpt_torch_dist_dp_reshardable",
    "fully_reshardable": "ckpt_torch_dist_fully_reshardable",
}


def available(run: str) -> list[str]:
    return [f for f, folder in FORMATS.items() if (GPT / run / folder).is_dir()]


@functools.cache
def expected(run: str) -> dict[str, np.ndarray]:
    with np.load(GPT / run / "expected.npz") as f:
        return {k: f[k] for k in f.files}


def trace(run: str) -> list[dict]:
    return json.loads((GPT / run / "trace.json").read_text())


def config(run: str, mesh: dict, path: str, strategy: str):
    """Megatron's run in jzero's keys: its model, AdamW (lr 1e-2 constant: no warmup, and a cosine decay
    over 10**9 steps is 1e-2 to the bit at steps 11..15), clipping, global batch."""
    return from_dict({
        "model": MODELS[run], "data": {"kind": "synthetic"}, "mesh": mesh,
        "zero": {"path": path, "strategy": strategy},
        "optimizer": {"lr": 1e-2, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 0,
                      "clip_grad": CLIP[run]},
        "train": {"steps": 10**9, "global_batch": GLOBAL_BATCH[run], "eval_every": 0},
    })  # fmt: skip


def setup(run: str, mesh: dict, path: str, strategy: str):
    from jzero.train.loop import setup as run_setup

    devices = jax.devices()[: int(np.prod(list(mesh.values())))]
    r = run_setup(config(run, mesh, path, strategy), devices, with_data=False)
    names, _ = gpt_names(r.model.abstract_params(), megatron_names(r.cfg.model))
    return r, names


def flat_names(names) -> list[str]:
    return [n for r in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, megatron.Renamed)) for n in r.names]


def to_megatron(names, tree) -> dict[str, np.ndarray]:
    """A jzero params-shaped tree as Megatron's arrays by name (`names`' conversions)."""
    out = {}
    for r, x in zip(jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, megatron.Renamed)), jax.tree.leaves(tree)):
        out |= dict(zip(r.names, r.to_megatron(np.asarray(x))))
    return out


def batch(run: str, zero, step: int):
    """Megatron's global batch of 1-based `step` as jzero's [B, T + 1] tokens (labels are the next tokens)."""
    e = expected(run)
    tokens = np.concatenate([e["tokens"][step - 1], e["labels"][step - 1][:, -1:]], axis=1).astype(np.int32)
    assert np.array_equal(e["labels"][step - 1][:, :-1], tokens[:, 1:-1])
    return jax.device_put(tokens, zero.batch_sharding)


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)


# ---------------------------------------------------------------- reading: bit for bit


CASES = [(run, fmt) for run in MODELS for fmt in available(run)]


@pytest.mark.parametrize("run, fmt", CASES)
def test_read_joins_megatrons_ranks_bit_for_bit(run, fmt):
    """Every format of every run reads to Megatron's whole model (its TP=1, PP=1, EP=1 names and shapes),
    weights, main params and both moments bit for bit, in registration order; the tied copy dropped."""
    ck = megatron.read(GPT / run / FORMATS[fmt])
    e = expected(run)
    assert ck.iteration == STEP and ck.adam_step == STEP
    names = [k.split("/", 1)[1] for k in e if k.startswith("params_step10/")]
    assert sorted(ck.model) == sorted(names)
    if fmt != "fully_reshardable":
        assert ck.parallel == ((1, 1, 2) if run == "moe_ep2" else (2, 2, 1))
    for key, prefix in (("model", "params_step10"), ("main", "main_param_step10"), ("exp_avg", "exp_avg_step10"),
                        ("exp_avg_sq", "exp_avg_sq_step10")):  # fmt: skip
        for name, x in getattr(ck, key).items():
            np.testing.assert_array_equal(x, e[f"{prefix}/{name}"], err_msg=f"{key} {name}")
    cfg = config(run, {"dp": 8}, "spec", "optim").model
    order = [n for n in megatron_names(cfg) if not n.endswith(megatron.EXTRA_STATE)]
    assert list(ck.model) == order  # Megatron's registration order of the whole model


# ---------------------------------------------------------------- into jzero, and on


MEASURED: dict[str, float] = {}


def _continue(run: str, fmt: str, mesh: dict, path: str, strategy: str):
    r, names = setup(run, mesh, path, strategy)
    zero = r.zero
    state = megatron.load(GPT / run / FORMATS[fmt], zero, names)
    assert int(state.step) == STEP
    e = expected(run)
    # what landed is Megatron's step-10 state, bit for bit
    params = to_megatron(names, jax.device_get(zero.full_params(state.params)))
    model_opt = jax.device_get(zero.to_model_space(state.opt_state))
    adam = model_opt.inner_state[0]
    for key, tree in (("params_step10", None), ("exp_avg_step10", adam.mu), ("exp_avg_sq_step10", adam.nu)):
        arrays = params if tree is None else to_megatron(names, tree)
        for name, x in arrays.items():
            np.testing.assert_array_equal(x, e[f"{key}/{name}"], err_msg=f"{key} {name}")
    losses, norms = [], []
    for step in range(STEP + 1, STEP + 6):
        state, m = zero.step(state, batch(run, zero, step))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    want = trace(run)[STEP : STEP + 5]
    errs = {
        "loss": max(abs(a - s["loss"]) / abs(s["loss"]) for a, s in zip(losses, want)),
        "grad_norm": max(abs(a - s["grad_norm"]) / abs(s["grad_norm"]) for a, s in zip(norms, want)),
    }
    final = to_megatron(names, jax.device_get(zero.full_params(state.params)))
    errs["params"] = max(rel(x, e[f"params_step15/{name}"]) for name, x in final.items())
    for k, v in errs.items():
        MEASURED[k] = max(MEASURED.get(k, 0.0), v)
    assert all(v <= REL for v in errs.values()), f"{run} {fmt} {mesh} {path} {strategy}: {errs}"


FAST = [  # the fast subset's one, on the spec path; with SLOW every run on both paths and every format
    ("tp2pp2/untied", "dp_reshardable", {"dp": 2, "tp": 2}, "spec", "optim_grads"),
]
SLOW = [  # every run on the flat path, every format, and a mesh of all three axes
    ("moe_ep2", "fully_reshardable", {"dp": 8}, "spec", "optim_grads"),
    ("tp2pp2/untied", "legacy", {"dp": 8}, "flat", "optim"),
    ("tp2pp2/tied", "legacy", {"dp": 2, "tp": 2}, "flat", "optim_grads"),
    ("moe_ep2", "legacy", {"dp": 4, "ep": 2}, "flat", "optim"),
    ("tp2pp2/untied", "fully_reshardable", {"dp": 4, "tp": 2}, "flat", "optim_grads"),
    ("moe_ep2", "dp_reshardable", {"dp": 2, "ep": 2, "tp": 2}, "spec", "optim"),
]


@pytest.mark.parametrize("run, fmt, mesh, path, strategy", FAST)
def test_continue_megatron_parallel_run(run, fmt, mesh, path, strategy):
    """Megatron's step-10 checkpoint on a jzero mesh of another shape: Megatron's state bit for bit, then
    steps 11..15 as Megatron trained them (losses, grad norms, step-15 params)."""
    _continue(run, fmt, mesh, path, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("run, fmt, mesh, path, strategy", SLOW)
def test_continue_megatron_parallel_run_elsewhere(run, fmt, mesh, path, strategy):
    _continue(run, fmt, mesh, path, strategy)


# ---------------------------------------------------------------- bad input: one line each


def refused(fn, *fragments):
    with pytest.raises(InteropError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg


def test_bad_parallel_checkpoints_are_one_line(tmp_path):
    legacy = GPT / "tp2pp2" / "untied" / "ckpt_legacy"
    # a missing model-parallel rank
    gone = tmp_path / "gone"
    shutil.copytree(legacy, gone)
    shutil.rmtree(gone / "iter_0000010" / "mp_rank_01_001")
    refused(lambda: megatron.read(gone), "lacks mp_rank_01_001", "incomplete")
    # a rank whose buffer does not fit its params (another model's optimizer file)
    mixed = tmp_path / "mixed"
    shutil.copytree(legacy, mixed)
    shutil.copy(legacy / "iter_0000010" / "mp_rank_00_001" / "distrib_optim.pt",
                mixed / "iter_0000010" / "mp_rank_00_000" / "distrib_optim.pt")  # fmt: skip
    refused(lambda: megatron.read(mixed), "mp_rank_00_000", "3088 elements", "--ddp-bucket-size")
    # a TP slice of another shape: its rank's buffer no longer fits its params
    odd = tmp_path / "odd"
    shutil.copytree(legacy, odd)
    f = odd / "iter_0000010" / "mp_rank_01_000" / "model_optim_rng.pt"
    sd = torch_format.load(f)
    sd["model"]["decoder.layers.0.self_attention.linear_qkv.weight"] = np.zeros((8, 16), np.float32)
    torch_format.save(sd, f)
    refused(lambda: megatron.read(odd), "mp_rank_01_000", "3072 elements", "has 2944")
    # the tied copy differs from the embedding
    tied = tmp_path / "tied"
    shutil.copytree(GPT / "tp2pp2" / "tied" / "ckpt_legacy", tied)
    f = tied / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"
    sd = torch_format.load(f)
    sd["model"]["output_layer.weight"] = sd["model"]["output_layer.weight"] + 1
    torch_format.save(sd, f)
    cfg = config("tp2pp2/tied", {"dp": 8}, "spec", "optim").model
    names = [n for n in megatron_names(cfg) if not n.endswith(megatron.EXTRA_STATE)]
    refused(lambda: megatron.read(tied, names=names), "output_layer.weight", "differs from", "tied")
    # an optimizer key jzero does not read; a sharding type it does not
    dist = tmp_path / "dist"
    shutil.copytree(GPT / "tp2pp2" / "untied" / "ckpt_torch_dist_fully_reshardable", dist)
    common = torch_format.load(dist / "common.pt")
    torch_format.save({**common, "optimizer": {**common["optimizer"], "param_state_sharding_type": "dp_reshardable"}},
                      dist / "common.pt")  # fmt: skip
    refused(lambda: megatron.read(dist), "optimizer key optimizer.state.", "dp_reshardable")
    torch_format.save({**common, "optimizer": {"param_state_sharding_type": "fully_sharded_model_space"}},
                      dist / "common.pt")  # fmt: skip
    refused(lambda: megatron.read(dist), "fully_sharded_model_space", "0.16.1 cannot write it")


def test_moe_names_convert_exactly_both_ways():
    """jzero's MoE GPT (router [D, E], experts stacked [E, ...], scanned or not) as Megatron's per-expert
    names and back, bit for bit; Megatron's shapes per expert."""
    from jzero.train.model import GPTModel

    for scan in (False, True):
        cfg = from_dict({"model": {**MODELS["moe_ep2"], "scan_layers": scan, "bias": True, "norm": "layernorm"},
                         "data": {"kind": "synthetic"}}).model  # fmt: skip
        abstract = GPTModel(cfg).abstract_params()
        names, order = gpt_names(abstract, megatron_names(cfg))
        params = jax.tree.map(lambda x: np.random.default_rng(x.size).standard_normal(x.shape).astype(np.float32),
                              abstract)  # fmt: skip
        out = to_megatron(names, params)
        assert sorted(out) == sorted(k for k in order if not k.endswith(megatron.EXTRA_STATE))
        assert out["decoder.layers.1.mlp.router.weight"].shape == (4, 16)
        assert out["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (32, 16)
        assert out["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"].shape == (16, 16)
        assert out["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.bias"].shape == (32,)
        blocks = params["blocks"] if scan else params["blocks"][1]
        fc2 = blocks["mlp"]["experts"]["fc2"]["kernel"]
        np.testing.assert_array_equal(out["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"],
                                      (fc2[1, 3] if scan else fc2[3]).T)  # fmt: skip
        for r, x in zip(jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, megatron.Renamed)),
                        jax.tree.leaves(params)):  # fmt: skip
            np.testing.assert_array_equal(r.from_megatron(tuple(out[n] for n in r.names)), x)


@pytest.mark.slow
def test_cli_imports_a_parallel_checkpoint(tmp_path, capsys):
    """`jzero ckpt import-megatron` on Megatron's TP 2 x PP 2 legacy checkpoint and on the MoE one: a jzero
    checkpoint at step 10, the joined ranks named in its notes."""
    from jzero.cli import main

    joined = {"tp2pp2/untied": "joined 4 model-parallel ranks: tp 2, pp 2, ep 1",
              "moe_ep2": "joined 2 model-parallel ranks: tp 1, pp 1, ep 2"}  # fmt: skip
    for run, note in joined.items():
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(json.dumps({
            "model": MODELS[run], "data": {"kind": "synthetic"}, "zero": {"path": "flat", "strategy": "optim_grads"},
            "optimizer": {"lr": 0.01, "b2": 0.95, "warmup_steps": 0, "clip_grad": CLIP[run]},
            "train": {"steps": 20, "global_batch": GLOBAL_BATCH[run], "eval_every": 0},
        }))  # fmt: skip
        out = tmp_path / run.replace("/", "_")
        assert main(["ckpt", "import-megatron", str(GPT / run / "ckpt_legacy"), str(out), str(cfg)]) == 0
        text = capsys.readouterr().out
        assert "imported Megatron iteration 10 (legacy" in text and note in text, text
    # the MoE exports back (test_megatron_export_parallel.py checks the files)
    assert main(["ckpt", "export-megatron", str(out), str(tmp_path / "m"), str(cfg)]) == 0
    assert "exported jzero step 10" in capsys.readouterr().out
