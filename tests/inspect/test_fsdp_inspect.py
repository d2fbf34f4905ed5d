"""ZeRO-3, per-unit ZeRO-2 and HSDP in `jzero hlo` and `jzero memory` (docs/inspect.md, docs/megatron.md).

The wire bytes are counted per step (a collective in the layer loop x its runs) and equal the
theory (`comms.theory`) up to the loss and grad-norm scalars, on a model whose every tensor
shards over the DP domain and has no bias (an output bias is the one param a unit's backward
does not need, so ZeRO-3 gathers it once, not twice). The state read from the shardings equals
the formula: ZeRO-3 divides params, grads and state by d, HSDP by d_i what it shards over the
inner axes only. Each program is compiled once and serves several checks.
"""

import dataclasses
import functools

import jax
import pytest

from helpers import tiny_config
from helpers.commands import needs_cuda
from jzero.config import validate
from jzero.inspect import comms, memory
from jzero.inspect.compile import CompiledStep, abstract_state, compile_step, setup_without_data
from jzero.inspect.targets import TARGETS
from jzero.zero.memory import formula_split

L = 3  # scanned blocks: XLA may peel one iteration of a layer loop out of it
MODEL = {"scan_layers": True, "bias": False, "n_layers": L}


def config(strategy, dp_outer=1, outer="no_shard", overlap=False, **precision):
    zero = {"outer_strategy": outer, "overlap_grad_reduce": overlap}  # without overlap unless asked (its own tests)
    cfg = tiny_config(strategy, (8 // dp_outer, 1, 1), model=MODEL, zero=zero, precision=precision)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp_outer=dp_outer))
    validate(cfg)
    return cfg


@functools.cache
def hlo_doc(strategy, dp_outer=1, outer="no_shard", overlap=False) -> dict:
    """`jzero hlo`'s document of one strategy on 8 CPU devices (fp32 params: XLA:CPU gathers bf16 in f32)."""
    return comms.analyze(compile_step(config(strategy, dp_outer, outer, overlap)))


def per_step(doc, kind, axes) -> float:
    return sum(
        r["wire_bytes_per_step"] for r in doc["per_step"]["collectives"] if (r["kind"], r["axes"]) == (kind, axes)
    )


def in_loop(doc, kind) -> list[dict]:
    """The DP collectives of `kind` scheduled in a loop body that runs at least L - 1 times per step."""
    sch = doc["schedule"]
    return [
        r for r in sch["collectives"] if r["kind"] == kind and r["computation"] != sch["entry"] and r["runs"] >= L - 1
    ]


def assert_theory(doc):
    """DP wire per step = the theory, but for the loss and grad-norm scalars' all-reduces."""
    th = doc["theory"]
    assert 0 <= doc["per_step"]["dp_wire_bytes"] - th["wire_bytes"] <= 128
    assert round(doc["ratio"], 3) == 1.0
    for kind in ("reduce-scatter", "all-gather"):
        assert doc["per_step"]["dp_wire_bytes_by_kind"].get(kind, 0.0) == pytest.approx(th["by_kind"].get(kind, 0.0))


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.matrix
def test_unit_collectives_per_step_are_the_theory(strategy):
    """8 CPU devices, dp=8: ZeRO-2 reduce-scatters each unit's grads in the layer loop, ZeRO-3 also
    gathers each unit's params there, twice (reshard_after_forward); explicit psum_scatter and
    all_gather in shard_map, so real reduce-scatters on CPU too."""
    doc = hlo_doc(strategy)
    th, d = doc["theory"], 8
    g, p, pu = th["grad_bytes"], th["param_bytes"], th["unit_param_bytes"]
    assert g == p and 0 < pu < p  # fp32; the embeddings, final norm and head are in no unit
    zero3 = strategy == "optim_grads_params"
    assert th["formula"] == ("(d-1)/d*(G + P + P_unit)" if zero3 else "(d-1)/d*(G + P)")
    assert per_step(doc, "reduce-scatter", ["dp"]) == pytest.approx((d - 1) / d * g)
    assert per_step(doc, "all-gather", ["dp"]) == pytest.approx((d - 1) / d * (p + pu if zero3 else p))
    assert_theory(doc)
    # The bug this fixes: one instruction per loop body undercounts the step's bytes.
    assert doc["dp_wire_bytes"] < 0.8 * doc["per_step"]["dp_wire_bytes"]
    assert not any("no reduce-scatter" in n for n in doc["notes"])
    # Inside the layer loop: at least L - 1 of L runs of every unit's reduce-scatter (and gathers).
    loop_rs = sum(r["wire_bytes"] * r["runs"] for r in in_loop(doc, "reduce-scatter"))
    assert loop_rs >= (L - 1) / L * (d - 1) / d * pu
    if zero3:
        loop_ag = sum(r["wire_bytes"] * r["runs"] for r in in_loop(doc, "all-gather"))
        assert loop_ag >= (L - 1) / L * 2 * (d - 1) / d * pu


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.slow
def test_hsdp_reduces_inner_then_across_dp_outer(outer):
    """ZeRO-3 on dp_outer=2 x dp=4: grads reduce-scatter over dp (d_i=4), then across dp_outer the
    1/d_i that is left is all-reduced (no_shard) or reduce-scatted (optim); params gather over dp,
    and under optim across dp_outer after the step."""
    doc = hlo_doc("optim_grads_params", 2, outer)
    th = doc["theory"]
    g, p, pu, d_i, d_o = th["grad_bytes"], th["param_bytes"], th["unit_param_bytes"], 4, 2
    assert th["domains"]["dense"]["d_inner"] == d_i and th["domains"]["dense"]["d_outer"] == d_o
    assert per_step(doc, "reduce-scatter", ["dp"]) == pytest.approx((d_i - 1) / d_i * g)
    assert per_step(doc, "all-gather", ["dp"]) == pytest.approx((d_i - 1) / d_i * (p + pu))
    if outer == "no_shard":
        # A ring all-reduce over 2 sends what it holds: 2 (d_o-1)/d_o x G/d_i = G/d_i, 1/d_i of the grads.
        assert per_step(doc, "all-reduce", ["dp_outer"]) == pytest.approx(g / d_i)
        assert not per_step(doc, "reduce-scatter", ["dp_outer"]) and not per_step(doc, "all-gather", ["dp_outer"])
        assert th["formula"] == "(d_i-1)/d_i*(G + P + P_unit) + 2(d_o-1)/d_o*G/d_i"
    else:
        assert per_step(doc, "reduce-scatter", ["dp_outer"]) == pytest.approx((d_o - 1) / d_o * g / d_i)
        assert per_step(doc, "all-gather", ["dp_outer"]) == pytest.approx((d_o - 1) / d_o * p / d_i)
        assert per_step(doc, "all-reduce", ["dp_outer"]) == 0
    assert_theory(doc)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hsdp_zero1_with_overlap_reduces_inner_then_across_dp_outer(outer):
    """ZeRO-1 on dp_outer=2 x dp=4 with overlap_grad_reduce (the default): each unit's grads
    reduce-scatter over dp in the backward, then the 1/d_i left is all-reduced (no_shard) or
    reduce-scattered (optim) across dp_outer, and the params gather back the same way: the
    hierarchical theory, where without overlap XLA all-reduces over all 8 and slices (1.429 x it with
    no_shard, 1.500 with optim; docs/inspect.md)."""
    doc = hlo_doc("optim", 2, outer, overlap=True)
    th = doc["theory"]
    g, p, d_i, d_o = th["grad_bytes"], th["param_bytes"], 4, 2
    assert per_step(doc, "reduce-scatter", ["dp"]) == pytest.approx((d_i - 1) / d_i * g)
    assert per_step(doc, "all-gather", ["dp"]) == pytest.approx((d_i - 1) / d_i * p)
    if outer == "no_shard":
        assert per_step(doc, "all-reduce", ["dp_outer"]) == pytest.approx(2 * (d_o - 1) / d_o * g / d_i)
        assert th["formula"] == "(d_i-1)/d_i*(G + P) + 2(d_o-1)/d_o*G/d_i"
    else:
        assert per_step(doc, "reduce-scatter", ["dp_outer"]) == pytest.approx((d_o - 1) / d_o * g / d_i)
        assert per_step(doc, "all-gather", ["dp_outer"]) == pytest.approx((d_o - 1) / d_o * p / d_i)
        assert per_step(doc, "all-reduce", ["dp_outer"]) == 0
    assert_theory(doc)
    assert in_loop(doc, "reduce-scatter")  # per unit, in the backward's layer loop


@pytest.mark.slow
def test_hsdp_ddp_with_overlap_is_a_hierarchical_all_reduce():
    """DDP on dp_outer=2 x dp=4 with overlap_grad_reduce (the default): each grad is reduce-scattered
    over dp in the backward, its 1/d_i all-reduced across dp_outer and all-gathered back over dp: DDP's
    bytes, 2(d-1)/d G, of which only G/d_i crosses dp_outer. Without overlap XLA all-reduces over all
    8 in one collective (the same bytes) and a note says so."""
    doc = hlo_doc("no_shard", 2, overlap=True)
    th = doc["theory"]
    g, d, d_i, d_o = th["grad_bytes"], 8, 4, 2
    assert per_step(doc, "reduce-scatter", ["dp"]) == pytest.approx((d_i - 1) / d_i * g)
    assert per_step(doc, "all-reduce", ["dp_outer"]) == pytest.approx(2 * (d_o - 1) / d_o * g / d_i)
    assert per_step(doc, "all-gather", ["dp"]) == pytest.approx((d_i - 1) / d_i * g)
    assert per_step(doc, "all-reduce", ["dp_outer", "dp"]) < 128  # the loss and grad-norm scalars
    assert th["wire_bytes"] == pytest.approx(2 * (d - 1) / d * g)
    assert th["formula"] == "(d_i-1)/d_i*(G + G) + 2(d_o-1)/d_o*G/d_i"
    assert_theory(doc)
    assert in_loop(doc, "reduce-scatter") and in_loop(doc, "all-gather")  # per unit, in the backward
    off = hlo_doc("no_shard", 2)
    assert per_step(off, "all-reduce", ["dp_outer", "dp"]) == pytest.approx(2 * (d - 1) / d * g, abs=128)
    assert round(off["ratio"], 3) == 1.0
    assert any(n.startswith("no reduce-scatter: DDP's grads are all-reduced") for n in off["notes"])


@pytest.mark.parametrize(
    "strategy, dp_outer, outer",
    [("optim_grads_params", 1, "no_shard"), ("optim_grads_params", 2, "no_shard"), ("optim_grads_params", 2, "optim"),
     ("optim_grads", 2, "no_shard"), ("optim", 2, "optim")],
)  # fmt: skip
def test_state_is_the_formula(strategy, dp_outer, outer):
    """bf16 params, fp32 grads (no compile: the state is read from the shardings): ZeRO-3 is 18 P/d
    (params 2, grads 4, main params 4, Adam 8 bytes, all / d); under HSDP params are / d_i, and the
    state and sharded grads / d_i, or / d with outer_strategy optim."""
    run = setup_without_data(config(strategy, dp_outer, outer, param_dtype="bfloat16"), None)
    c = CompiledStep(run, None, abstract_state(run), "cpu", None, 0.0)
    state, formula = memory.state_bytes(c), formula_split(run.zero)
    for part in ("params", "main_params", "grads"):
        assert state[part] == formula[part], part
    assert 0 <= state["optimizer_moments"] - formula["optimizer_moments"] <= 16  # Adam's step counters
    n = sum(t.numel for t in jax.tree.leaves(run.zero.plan.tensors))  # tp=1: every rank's P
    d, d_i = 8, 8 // dp_outer
    d_state = d if outer == "optim" else d_i
    zero3, shards_grads = strategy == "optim_grads_params", strategy != "optim"
    assert formula["params"] == 2 * n / (d_i if zero3 else 1)
    assert formula["grads"] == 4 * n / (d_state if shards_grads else 1)
    assert formula["main_params"] + formula["optimizer_moments"] == 12 * n / d_state
    if zero3 and dp_outer == 1:
        assert sum(formula.values()) == 18 * n / d


def test_zero3_formula_with_16_bit_grads_is_the_zero_papers():
    """bf16 params and grads (the ZeRO paper's fp16/fp16): stage 3 holds (2 + 2 + K) P / N, K = 12."""
    run = setup_without_data(config("optim_grads_params", param_dtype="bfloat16", grad_reduce_dtype="bfloat16"), None)
    n = sum(t.numel for t in jax.tree.leaves(run.zero.plan.tensors))
    assert sum(formula_split(run.zero).values()) == (2 + 2 + 12) * n / 8
    c = CompiledStep(run, None, abstract_state(run), "cpu", None, 0.0)
    assert memory.state_bytes(c)["params"] == 2 * n / 8


@needs_cuda
@pytest.mark.slow
def test_deviceless_h100_zero3_gathers_bf16_per_unit_and_fits():
    """8 H100s, bf16 params: ZeRO-3's per-unit gathers move bf16 (no f32 as on CPU) and the step moves
    the theory's bytes; `jzero memory`'s state is the formula, 18 P/d, and fits."""
    c = compile_step(config("optim_grads_params", param_dtype="bfloat16"), "h100")
    doc = comms.analyze(c)
    assert {d for r in doc["collectives"] if r["kind"] == "all-gather" for d in r["dtypes"]} == {"bf16"}
    assert_theory(doc)
    assert in_loop(doc, "all-gather") and in_loop(doc, "reduce-scatter")
    mem = memory.analyze(c, TARGETS["h100"].memory_bytes)
    n = sum(t.numel for t in jax.tree.leaves(c.run.zero.plan.tensors))
    assert mem["fits"] and mem["formula"]["total"] == 18 * n / 8
    assert 0 <= mem["state"]["total"] - mem["formula"]["total"] <= 16
