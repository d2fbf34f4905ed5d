"""`jzero memory` and `jzero hlo` on a mixture of experts: two data-parallel domains.

Dense params are data-parallel over d = dp x ep, expert params (split over ep) over edp = dp
(docs/megatron.md, "Bytes per parameter"): the formula and the wire theory take each domain
with its own size, and the tokens' all-to-all over ep is activation traffic, never DP.
"""

import json
from pathlib import Path

import jax
import pytest

from helpers import tiny_config
from helpers.commands import TINY, jzero, needs_cuda
from jzero.config import load_config
from jzero.mesh import DENSE_DP_AXES, EXPERT_DP_AXES
from jzero.train import moe
from jzero.train.loop import setup
from jzero.train.model import GPTModel
from jzero.train.report import measured_bytes
from jzero.zero.memory import formula_bytes, formula_domains

MOE = [*TINY, "model.moe.num_experts=4", "model.moe.top_k=2"]  # one MoE block, fc1 [E=4, 32, 64]
MESHES = [(2, 2, 2), (4, 2, 1)]  # (dp, ep, tp)


def mesh_args(mesh) -> list[str]:
    dp, ep, tp = mesh
    return [f"mesh.dp={dp}", f"mesh.ep={ep}", f"mesh.tp={tp}"]


def doc_of(tmp_path, command: str, overrides: list[str], *argv) -> dict:
    out = tmp_path / f"{command}.json"
    assert jzero([command, *argv, "--json", str(out)], overrides) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.slow
def test_memory_state_is_the_two_domain_formula(tmp_path, mesh, strategy):
    """bf16 params: the laid-out state is Megatron's formula with d = dp x ep for dense params and
    edp = dp for expert params (tp-local, E/ep experts per rank)."""
    dp, ep, tp = mesh
    over = [*MOE, *mesh_args(mesh), "precision.param_dtype=bfloat16", "zero.overlap_grad_reduce=false"]
    doc = doc_of(tmp_path, "memory", over, "--strategies", strategy)
    d, edp = dp * ep, dp
    assert (doc["d"], doc["edp"]) == (d, edp) and 0 < doc["expert_params"] < doc["params"]
    s = doc["strategies"][strategy]
    state, formula, domains = s["state"], s["formula"], s["formula_domains"]
    for part in ("params", "main_params", "grads"):
        assert state[part] == formula[part], part
    assert 0 <= state["optimizer_moments"] - formula["optimizer_moments"] <= 16  # Adam's step counters
    assert (domains["dense"]["d"], domains["expert"]["d"]) == (d, edp)
    assert domains["dense"]["axes"] == list(DENSE_DP_AXES) and domains["expert"]["axes"] == list(EXPERT_DP_AXES)
    # The compiled arguments are the state, the step counter and this device's batch rows.
    batch = 32 * 17 * 4 // d
    assert s["compiled"]["argument"] == state["params"] + state["main_params"] + state["optimizer_moments"] + 4 + batch
    # Per rank: dense params tp-local, expert params tp- and ep-local: this rank's E/ep experts'
    # fc1 [D, F_tp] + bias [F_tp] and fc2 [F_tp, D] + bias [D] (replicated over tp).
    dense, expert = domains["dense"]["numel"], domains["expert"]["numel"]
    e_local, f_tp = 4 // ep, 64 // tp
    assert expert == e_local * (2 * 32 * f_tp + f_tp + 32)
    assert (dense + expert * ep) * tp >= doc["params"] > dense + expert  # equal at tp=1; tp-replicated norms aside
    shard_state = strategy != "no_shard"
    shard_grads = strategy == "optim_grads"
    assert state["params"] == 2 * (dense + expert)
    assert state["main_params"] == 4 * (dense / (d if shard_state else 1) + expert / (edp if shard_state else 1))
    assert state["grads"] == 4 * (dense / (d if shard_grads else 1) + expert / (edp if shard_grads else 1))


def test_training_summary_uses_the_two_domain_formula():
    """`report.summarize`'s measured bytes (the arrays' shards) equal its formula on a MoE run."""
    cfg = tiny_config("optim_grads", (2, 2, 2), model={"moe": {"num_experts": 4, "top_k": 2}})
    run = setup(cfg)
    measured, formula = measured_bytes(run, run.init_state()), formula_bytes(run.zero)
    assert measured["params"] == formula["params"] and measured["grads"] == formula["grads"]
    assert 0 <= measured["optimizer_state"] - formula["optimizer_state"] <= 16
    domains = formula_domains(run.zero)
    assert set(domains) == {"dense", "expert"} and (domains["dense"]["d"], domains["expert"]["d"]) == (4, 2)
    ddp = formula_bytes(run.zero, ddp=True)
    assert ddp["grads"] == sum(dom["numel"] for dom in domains.values()) * 4


@pytest.mark.slow
def test_spec_path_on_cpu_reduces_each_domain_over_its_axes(tmp_path, capsys):
    """DDP on 8 CPU devices, dp 2 x ep 2 x tp 2: expert grads all-reduce over dp, dense grads over
    dp x ep, tokens all-to-all over ep; the DP bytes are the two-domain theory, the tokens apart."""
    doc = doc_of(tmp_path, "hlo", [*MOE, *mesh_args((2, 2, 2))], "--strategies", "no_shard")
    s = doc["strategies"]["no_shard"]
    th = s["theory"]["domains"]
    by_axes = {tuple(r["axes"]): r for r in s["collectives"] if r["kind"] == "all-reduce"}
    assert by_axes[("dp",)]["payload_bytes"] == th["expert"]["grad_bytes"]
    assert 0 <= by_axes[("dp", "ep")]["payload_bytes"] - th["dense"]["grad_bytes"] <= 16  # the loss beside it
    (a2a,) = [r for r in s["collectives"] if r["kind"] == "all-to-all"]
    assert a2a["axes"] == ["ep"] and s["all_to_all_wire_bytes"] == a2a["wire_bytes"] > 0
    assert s["ratio"] == pytest.approx(1.0, rel=1e-3)
    for name in ("dense", "expert"):
        assert 0 <= s["dp_wire_bytes_by_domain"][name] - th[name]["wire_bytes"] <= 128
    # Tokens: every all-to-all carries this rank's [E, C, D] slots (4 per MoE block: 2 forward, 2 backward).
    tok = s["tokens"]
    cap = moe.capacity(32 // 4 * 16, 4, 2, 1.25)
    assert tok["slot_bytes"] == 4 * cap * 32 * 4 and a2a["payload_bytes"] == 4 * tok["slot_bytes"]
    assert tok["measured"]["per_step_wire_bytes"] == tok["per_step_wire_bytes"] == 4 * tok["wire_bytes"]
    out = capsys.readouterr().out
    assert "tokens (not DP): all-to-all over ep" in out and "edp=2" in out


@pytest.mark.slow
def test_flat_path_moves_each_domains_padded_buffer(tmp_path):
    """Flat path on 8 CPU devices, dp 2 x ep 2 x tp 2, ZeRO-2: the dense buffer is reduce-scattered
    and gathered over dp x ep, the expert buffer over dp; measured/theory is their padding."""
    from jzero.inspect.compile import setup_without_data, with_zero
    from jzero.inspect.hlo import ring_wire_bytes

    over = [*MOE, *mesh_args((2, 2, 2)), "zero.overlap_grad_reduce=false"]  # one layout, the whole model's
    doc = doc_of(tmp_path, "hlo", over, "--path", "flat", "--strategies", "optim_grads")
    s = doc["strategies"]["optim_grads"]
    fp = setup_without_data(with_zero(load_config(None, over), "optim_grads", "flat"), None).zero.flat
    padded = {buf.kind: 4 * buf.layout.numel for buf in fp.buffers}  # fp32 grads and params
    rows = {(r["kind"], tuple(r["axes"])): r for r in s["collectives"]}
    for kind in ("reduce-scatter", "all-gather"):
        assert rows[(kind, ("dp",))]["payload_bytes"] == padded["expert"]
        assert rows[(kind, ("dp", "ep"))]["payload_bytes"] == padded["dense"]
    th = s["theory"]["domains"]
    wire = {name: 2 * ring_wire_bytes("reduce-scatter", padded[name], th[name]["d"]) for name in th}
    assert s["dp_wire_bytes_by_domain"]["expert"] == wire["expert"]
    assert 0 <= s["dp_wire_bytes_by_domain"]["dense"] - wire["dense"] <= 128  # the loss and metrics
    assert s["ratio"] == pytest.approx(sum(wire.values()) / s["theory"]["wire_bytes"], abs=1e-3)
    assert sum(n.startswith("flat expert buffer") for n in s["notes"]) == 1


@needs_cuda
@pytest.mark.slow
def test_deviceless_h100_reduce_scatters_each_domain(tmp_path):
    """8 H100s, spec path, ZeRO-2 with bf16 params: expert grads reduce-scatter over dp (edp),
    dense grads over dp x ep (d), each gathered back in bf16; measured/theory is 1 per domain."""
    over = [*MOE, *mesh_args((2, 2, 2)), "precision.param_dtype=bfloat16", "zero.overlap_grad_reduce=false"]
    doc = doc_of(tmp_path, "hlo", over, "--strategies", "optim_grads", "--target", "h100", "--topology", "1 x 1 x 8")
    s = doc["strategies"]["optim_grads"]
    th = s["theory"]["domains"]
    rows = {(r["kind"], tuple(r["axes"])): r for r in s["collectives"]}
    # The expert fc1 bias [E_ep, F_tp] is split over dp and tp on the same dim; XLA gathers it over tp
    # before its per-unit reduce-scatter (docs/xla.md, "Collectives inside a partially manual
    # shard_map"): 2 local experts x F=64 x 2 bytes x (tp - 1) = 256 bytes more than theory.
    extra = rows[("reduce-scatter", ("dp",))]["payload_bytes"] - th["expert"]["grad_bytes"]
    assert extra == 2 * 64 * 2 * (2 - 1)
    assert rows[("reduce-scatter", ("dp", "ep"))]["payload_bytes"] == th["dense"]["grad_bytes"]
    assert rows[("all-gather", ("dp",))]["payload_bytes"] == th["expert"]["param_bytes"]
    assert rows[("all-gather", ("dp", "ep"))]["payload_bytes"] == th["dense"]["param_bytes"]
    assert rows[("all-gather", ("dp",))]["dtypes"] == ["bf16"]
    assert rows[("all-to-all", ("ep",))]["dtypes"] == ["bf16"]  # the tokens, in param_dtype
    # The loss and MoE metrics (a few scalars) are reduced over dp x ep beside the grads.
    assert 0 <= s["dp_wire_bytes"] - s["theory"]["wire_bytes"] <= 128 + extra
    for name in ("dense", "expert"):
        assert 0 <= s["dp_wire_bytes_by_domain"][name] - th[name]["wire_bytes"] <= 128 + extra
    assert s["tokens"]["measured"]["per_step_wire_bytes"] == s["tokens"]["per_step_wire_bytes"]


@pytest.mark.slow
def test_mixtral_preset_is_46_7b_params():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "mixtral_8x7b.yaml")
    model = GPTModel(cfg.model)
    params = model.abstract_params()
    expert = jax.tree.leaves(model.is_expert(params))
    sizes = [x.size for x in jax.tree.leaves(params)]
    total, in_experts = sum(sizes), sum(n for n, e in zip(sizes, expert) if e)
    assert round(total / 1e9, 1) == 46.7 and round(in_experts / 1e9, 1) == 45.1
    # About 12.9B active per token: the dense params and top_k of the E experts.
    assert round((total - in_experts + in_experts * 2 / 8) / 1e9, 1) == 12.9
    assert cfg.n_devices == 64 and (cfg.mesh.ep, cfg.dp_domain_size) == (8, 64)


@pytest.mark.slow
def test_dropless_exchange_on_cpu_moves_padded_slices(tmp_path, capsys):
    """Dropless on 8 CPU devices, dp 2 x ep 2 x tp 2: XLA:CPU has no ragged all-to-all, so each exchange
    is a dense all-to-all of [ep, N min(k, E/ep), D] padded slices (and the counts and offsets); the
    tokens theory is the routed copies [k N, D] under uniform routing. The tile loops' trip counts
    are the routing's: the step's flops count each loop once and say so."""
    over = [*MOE, *mesh_args((2, 2, 2)), "model.moe.capacity_factor=null"]
    s = doc_of(tmp_path, "hlo", over, "--strategies", "optim")["strategies"]["optim"]
    tok = s["tokens"]
    n, k, d = 32 // 4 * 16, 2, 32
    assert tok["dropless"] and tok["slot_bytes"] == k * n * d * 4 and tok["measured"]["ragged_count"] == 0
    slices = 2 * n * min(k, 4 // 2) * d * 4  # [ep, N min(k, E/ep), D] fp32
    (a2a,) = [r for r in s["collectives"] if r["kind"] == "all-to-all"]
    assert a2a["axes"] == ["ep"] and 4 * slices <= a2a["payload_bytes"] < 4 * slices + 1024  # + counts, offsets
    assert s["schedule"]["unknown_trip_counts"] > 0
    out = capsys.readouterr().out
    assert "tokens (not DP), dropless: 0 ragged all-to-all(s)" in out and "counted once" in out


@pytest.mark.slow
@needs_cuda
def test_deviceless_h100_dropless_exchange_is_ragged(tmp_path):
    """The same on 8 H100s: every exchange (2 forward, 2 backward per MoE block) is a ragged
    all-to-all of the routed rows; only counts and offsets (s32) go by plain all-to-all."""
    over = [*MOE, *mesh_args((2, 2, 2)), "model.moe.capacity_factor=null", "precision.param_dtype=bfloat16"]
    doc = doc_of(tmp_path, "hlo", over, "--strategies", "optim_grads", "--target", "h100", "--topology", "1 x 1 x 8")
    s = doc["strategies"]["optim_grads"]
    tok = s["tokens"]
    assert tok["dropless"] and tok["measured"]["ragged_count"] == tok["per_step"] == 4
    assert {dt for r in s["collectives"] if r["kind"] == "all-to-all" for dt in r["dtypes"]} == {"s32"}
