"""The flat path per FSDP unit (`zero.overlap_grad_reduce`, and ZeRO-3): Megatron's buffers laid out per
unit, each bucket reduced (and under ZeRO-3 / overlap_param_gather gathered) inside the layer loop,
training to single-device optax's numbers; the params resting as bucket shards read back whole;
checkpoints between per-unit runs, the spec path and the flat path without overlap; `jzero layout`."""

import dataclasses
import functools
import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_fsdp import _restore_matches, _train_and_save
from test_spec_grads import assert_matches

from helpers import tiny_config
from jzero.cli import main
from jzero.config import validate
from jzero.inspect import comms
from jzero.inspect.compile import compile_step
from jzero.inspect.hlo import ring_wire_bytes
from jzero.train.checkpoint import Checkpointer
from jzero.train.loop import setup
from jzero.zero.flat.buffers import build_layout
from jzero.zero.flat.plan import REST
from jzero.zero.memory import formula_split, per_device_bytes

SCAN = {"scan_layers": True, "remat": True}
MOE = {"moe": {"num_experts": 4, "top_k": 2, "every": 2, "capacity_factor": 1.0}}


def flat_config(strategy, mesh=(8, 1, 1), microbatches=1, dp_outer=1, model=None, precision=None, **zero):
    cfg = tiny_config(
        strategy, mesh, microbatches, model=model or {}, zero={"path": "flat", **zero}, precision=precision or {},
        train={"global_batch": 24 if microbatches == 3 else 16},
    )  # fmt: skip
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp_outer=dp_outer))
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("model", [{}, SCAN, MOE], ids=["unrolled", "scanned", "moe"])
def test_each_unit_is_laid_out_as_megatron_lays_out_its_params(model):
    """One group per block (a scanned stack: one group, laid out per layer) and one of the rest; each
    group's buffer is `build_layout` of its params' local element counts, with the bucket size applied
    within the group; together the groups hold every param once."""
    mesh = (2, 2, 2) if "moe" in model else (4, 1, 2)
    run = setup(flat_config("optim_grads", mesh, model=model, bucket_size=3000), with_data=False)
    fp, tensors = run.zero.flat, jax.tree.leaves(run.zero.plan.tensors)
    n_layers = run.cfg.model.n_layers
    units = [g.key for g in fp.groups if g.key != REST]
    assert units == (["blocks"] if model.get("scan_layers") else [f"blocks/{i}" for i in range(n_layers)])
    assert sorted(i for g in fp.groups for i in g.params) == list(range(len(tensors)))
    for g in fp.groups:
        assert all(tensors[i].unit_dims is not None for i in g.params) == (g.key != REST)
        assert g.layers == (n_layers if g.key == "blocks" else None)
        for buf in g.buffers:
            numels = [math.prod(fp.layer_shape(i)) for i in buf.params]
            assert buf.layout == build_layout(numels, buf.layout.dp_size, 3000)
            assert set(buf.params) <= set(g.params) and buf.lead == ((g.layers,) if g.layers else ())
    kinds = {buf.kind for g in fp.groups if g.key != REST for buf in g.buffers}
    assert kinds == ({"dense", "expert"} if "moe" in model else {"dense"})


def test_a_scanned_stacks_buckets_are_stacked_per_layer():
    """[L, tp, S_b] buckets split over DP on S_b; the optimizer state as [L, tp, S_b] too; the model params,
    resting as bucket shards (ZeRO-2's overlap_param_gather), split over the inner DP axes."""
    run = setup(flat_config("optim_grads", (4, 1, 2), model=SCAN, bucket_size=3000), with_data=False)
    fp, z = run.zero.flat, run.zero
    stacked = [(buf, b) for buf, b in fp.buckets if buf.layers]
    assert len(stacked) > 1 and fp.params_rest_sharded
    dp = ("dp_outer", "dp", "ep")
    for k, (buf, b) in enumerate(fp.buckets):
        want = (*buf.lead, 2, buf.numel(b))
        assert fp.bucket_shapes()[k] == want and fp.shard_shape(k) == (*buf.lead, buf.numel(b) // 4)
        assert fp.bucket_specs()[k] == (P(None, "tp", dp) if buf.layers else P("tp", dp))
        assert z.shardings.params[k].spec == fp.bucket_specs()[k]  # inner axes = every DP axis here
    state = jax.eval_shape(run.init_state)
    assert [x.shape for x in state.params] == fp.bucket_shapes()
    moments = jax.tree_util.tree_flatten_with_path(state.opt_state.inner_state)[0]
    assert {x.shape == fp.bucket_shapes()[path[-1].idx] for path, x in moments if x.ndim} == {True}


# ---------------------------------------------------------------- fidelity


@pytest.mark.parametrize(
    "strategy, mesh, microbatches, dp_outer, model, zero",
    [
        ("optim_grads_params", (4, 1, 2), 2, 1, SCAN, {}),  # ZeRO-3: gathered per unit, twice, every micro-batch
        ("optim_grads_params", (8, 1, 1), 1, 1, {}, {}),  # unrolled blocks, a group each
        ("optim_grads_params", (2, 2, 2), 2, 1, MOE, {}),  # expert buckets over the expert-DP domain
        ("optim_grads_params", (2, 1, 2), 1, 2, SCAN, {"outer_strategy": "optim"}),  # HSDP, state across dp_outer
        ("optim", (8, 1, 1), 3, 1, SCAN, {}),  # gathered in the first, accumulated, reduced per unit in the last
        ("no_shard", (8, 1, 1), 3, 1, SCAN, {}),  # DDP: psum per unit in the last backward
        ("optim_grads", (4, 1, 2), 2, 1, SCAN, {}),  # gathered once, handed on, reduce-scattered every micro-batch
        ("optim_grads", (4, 1, 1), 2, 2, {}, {}),  # HSDP no_shard: inner psum_scatter, psum across dp_outer
        ("optim", (4, 1, 1), 1, 2, {}, {"outer_strategy": "optim"}),
        ("optim_grads", (8, 1, 1), 2, 1, SCAN, {"overlap_param_gather": False}),  # params rest whole
        ("optim_grads", (2, 2, 2), 1, 1, MOE, {"overlap_param_gather": False}),
        ("no_shard", (4, 1, 2), 1, 1, {}, {}),
        ("optim_grads_params", (8, 1, 1), 2, 1, SCAN, {"overlap_grad_reduce": False}),  # ZeRO-3 is per unit anyway
        ("optim", (4, 1, 2), 2, 1, SCAN, {"overlap_grad_reduce": False}),  # one layout, after the backward
    ],
    ids=[
        "zero3-tp2-scan-2mb", "zero3-dp8", "zero3-moe-2mb", "zero3-hsdp-optim", "zero1-scan-3mb", "ddp-scan-3mb",
        "zero2-tp2-scan-2mb", "zero2-hsdp", "zero1-hsdp-optim", "zero2-whole-params-2mb", "zero2-moe-whole-params",
        "ddp-tp2", "zero3-off-2mb", "zero1-off-tp2-2mb",
    ],
)  # fmt: skip
@pytest.mark.matrix
def test_every_flat_schedule_matches_single_device_optax(strategy, mesh, microbatches, dp_outer, model, zero):
    assert_matches(flat_config(strategy, mesh, microbatches, dp_outer, model, **zero))


# ---------------------------------------------------------------- the compiled program

NO_BIAS = {"scan_layers": True, "bias": False, "n_layers": 3}  # every unit's bucket without padding


@functools.cache
def compiled(strategy, microbatches=1) -> tuple[dict, object]:
    """(`jzero hlo`'s document, the flat plan) of one flat per-unit strategy on 8 CPU devices, fp32."""
    c = compile_step(flat_config(strategy, (8, 1, 1), microbatches, model=NO_BIAS))
    return comms.analyze(c), c.run.zero.flat


def _loop_and_step(doc, kind) -> tuple[float, float]:
    """Per-step wire bytes of the DP collectives of `kind`: (in a loop body, in the step itself)."""
    sch, loop, step = doc["schedule"], 0.0, 0.0
    for r in sch["collectives"]:
        if r["kind"] == kind and r["axes"] == ["dp"]:
            if r["computation"] == sch["entry"]:
                step += r["wire_bytes"] * r["runs"]
            else:
                loop += r["wire_bytes"] * r["runs"]
    return loop, step


@pytest.mark.parametrize("strategy, microbatches", [("optim_grads_params", 1), ("optim", 2), ("no_shard", 1)])
@pytest.mark.matrix
def test_each_units_buckets_are_reduced_inside_the_layer_loop(strategy, microbatches):
    """8 CPU devices, a scanned stack of 3 blocks: every unit bucket's reduction (ZeRO-3's and ZeRO-1's
    reduce-scatter in the last micro-batch, DDP's all-reduce) runs in the layer loop, once per layer; the
    rest group's once in the step; ZeRO-3 gathers each unit's bucket twice in the loop. The DP bytes per
    step are the ring formulas over the padded buckets, which are the theory's but for the rest group's
    64 elements of padding."""
    doc, fp = compiled(strategy, microbatches)
    d, units = 8, [buf for buf in fp.buffers if buf.layers]
    unit_bytes = 4 * sum(buf.layers * buf.layout.numel for buf in units)
    rest_bytes = 4 * sum(buf.layout.numel for buf in fp.buffers if not buf.layers)
    assert unit_bytes == 4 * sum(t.numel for t in jax.tree.leaves(fp.plan.tensors) if t.unit_dims)  # no padding
    reduce = "all-reduce" if strategy == "no_shard" else "reduce-scatter"
    loop, step = _loop_and_step(doc, reduce)
    assert loop == pytest.approx(ring_wire_bytes(reduce, unit_bytes, d))
    assert step - ring_wire_bytes(reduce, rest_bytes, d) == pytest.approx(0, abs=64)  # loss and norm scalars
    gathers = {"optim_grads_params": 2, "optim": 1, "no_shard": 0}[strategy]
    loop, step = _loop_and_step(doc, "all-gather")
    assert loop == pytest.approx(gathers * ring_wire_bytes("all-gather", unit_bytes, d))
    assert step == pytest.approx(ring_wire_bytes("all-gather", rest_bytes, d) if gathers else 0)
    laid_out = sum(math.prod(buf.lead) * buf.layout.numel for buf in fp.buffers)
    padding = laid_out - sum(t.numel for t in jax.tree.leaves(fp.plan.tensors))
    assert 0 < padding <= 64
    assert 1 <= doc["ratio"] < 1 + 64 / (rest_bytes / 4)


# ---------------------------------------------------------------- params resting as bucket shards


@pytest.mark.slow
def test_resting_bucket_shards_read_back_as_the_params():
    """ZeRO-3 on the flat path, bf16: the state holds one bf16 array per bucket, 1/d of it per device
    (the memory formula's padded bytes); `full_params` gives the params tree, which `params_from_model`
    lays back bitwise; `evaluate` on the state's params is the step's loss."""
    bf16 = {"param_dtype": "bfloat16"}
    run = setup(flat_config("optim_grads_params", (4, 1, 2), model=SCAN, precision=bf16, bucket_size=3000))
    state = run.init_state()
    z, fp = run.zero, run.zero.flat
    assert len(state.params) == fp.n_buckets
    padded = sum(math.prod(s) for s in fp.bucket_shapes()) // 2  # tp rows are 2 devices' halves
    assert per_device_bytes(state.params) == 2 * padded // 4 == formula_split(z)["params"]
    full = z.full_params(state.params)
    want = jax.jit(run.model.init)()
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(z.params_from_model(full)), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = run.device_batch(0)
    loss = float(z.evaluate(state.params, batch)["loss"])
    _, metrics = z.step(state, batch)
    assert loss == pytest.approx(float(metrics["loss"]), rel=1e-6)


# ---------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_checkpoints_move_between_flat_units_the_spec_path_and_flat_without_overlap(tmp_path):
    """Model space both ways: a flat per-unit ZeRO-3 checkpoint (bucket-shard params, stacked buckets)
    restores onto the spec path's ZeRO-2 and onto the flat path's ZeRO-1 without overlap (one layout),
    and theirs onto flat ZeRO-3, every shard the saved slice."""
    bf16 = {"precision": {"param_dtype": "bfloat16"}}
    flat3 = flat_config("optim_grads_params", (4, 1, 2), model=SCAN, precision=bf16["precision"])
    whole = _train_and_save(tmp_path / "a", flat3)
    assert "main_params" in whole
    _restore_matches(tmp_path / "a", whole, tiny_config("optim_grads", (8, 1, 1), model=SCAN, **bf16), train=True)
    off = tiny_config("optim", (4, 1, 2), model=SCAN, zero={"path": "flat", "overlap_grad_reduce": False}, **bf16)
    _restore_matches(tmp_path / "a", whole, off)
    whole = _train_and_save(tmp_path / "b", off)
    _restore_matches(tmp_path / "b", whole, flat3, train=True)


@pytest.mark.slow
def test_flat_zero3_resumes_bitwise(tmp_path):
    """Two steps, a checkpoint, one more step: the same state as three steps straight."""
    cfg = flat_config("optim_grads_params", (4, 1, 2), model=SCAN)
    run = setup(cfg)
    state = run.init_state()
    for i in range(2):
        state, _ = run.zero.step(state, run.device_batch(i))
    ck = Checkpointer(tmp_path / "ck", run, async_save=False)
    ck.save(state, cfg)
    ck.close()
    straight, _ = run.zero.step(state, run.device_batch(2))
    reader = Checkpointer(tmp_path / "ck", run, writer=False)
    resumed, _ = run.zero.step(reader.restore(2), run.device_batch(2))
    reader.close()
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- jzero layout


def test_layout_cli_prints_each_units_layout(capsys):
    """With units (the default, overlap on): one layout per block and the rest's, each its params' alone,
    every param's ranges tiled by the ranks."""
    argv = ["layout", "--set", "mesh.dp=4", "--set", "mesh.tp=2", "--set", "model.n_layers=2"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [g["unit"] for g in d["groups"]] == ["blocks/0", "blocks/1", None]
    for g in d["groups"]:
        (buf,) = g["buffers"]
        names = {p["name"] for p in buf["params"]}
        assert all(n.startswith(g["unit"] + "/") for n in names) if g["unit"] else not any("blocks" in n for n in names)
        covered = {}
        for r in buf["ranks"]:
            for o in r["owned"]:
                covered[o["name"]] = covered.get(o["name"], 0) + o["param"][1] - o["param"][0]
        assert covered == {p["name"]: p["numel"] for p in buf["params"]}
    assert main(argv + ["--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "group: FSDP unit blocks/1" in out and "group: params in no unit" in out and "rank 1 owns" in out
