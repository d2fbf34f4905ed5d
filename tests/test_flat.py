"""The explicit flat-buffer path: compiled collectives, exact optimizer bytes, refusals, `jzero layout`."""

import json
import math

import jax
import optax
import pytest

from helpers import tiny_config
from jzero.cli import main
from jzero.config import ConfigError
from jzero.inspect.hlo import axes_of_groups, parse_collectives
from jzero.train.loop import setup
from jzero.train.report import per_device_bytes
from jzero.zero.probe import check_elementwise

DP_AXES = {"dp_outer", "dp", "ep"}


def _compiled_collectives(run):
    state = run.init_state()
    text = run.zero.step.lower(state, run.device_batch(0)).compile().as_text()
    return [(c, set(axes_of_groups(c.replica_groups, run.mesh))) for c in parse_collectives(text)]


def test_zero2_step_reduce_scatters_and_all_gathers_the_buffer():
    cfg = tiny_config("optim_grads", (4, 1, 2), zero={"path": "flat", "bucket_size": 5000})
    run = setup(cfg)
    fp = run.zero.flat
    buffer_bytes = 4 * fp.layout.numel  # fp32 grads and params, tp-local
    cs = _compiled_collectives(run)
    rs = [c for c, axes in cs if c.kind == "reduce-scatter" and axes & DP_AXES]
    ag = [c for c, axes in cs if c.kind == "all-gather" and axes & DP_AXES]
    assert len(fp.layout.bucket_indices) > 1
    assert sum(c.payload_bytes for c in rs) == buffer_bytes  # every bucket reduce-scattered once
    assert sum(c.payload_bytes for c in ag) == buffer_bytes  # and all-gathered once
    # No all-reduce over the DP domain bigger than a scalar (loss, norm): no gradient all-reduce.
    dp_all_reduces = [c for c, axes in cs if c.kind == "all-reduce" and axes & DP_AXES]
    assert all(c.payload_bytes <= 8 for c in dp_all_reduces), dp_all_reduces


@pytest.mark.parametrize("microbatches", [1, 4])
def test_zero1_reduce_scatters_once_with_ddp_wire_bytes(microbatches):
    """Megatron's distributed optimizer: the full local buffer accumulates, one reduce-scatter after
    the last microbatch, one all-gather: DDP's all-reduce bytes (fp32 grads and params)."""
    kw = dict(microbatches=microbatches, zero={"path": "flat"}, train={"global_batch": 32})
    ddp, z1 = setup(tiny_config("no_shard", **kw)), setup(tiny_config("optim", **kw))
    buffer_bytes = 4 * z1.zero.flat.layout.numel
    ddp_cs, z1_cs = _compiled_collectives(ddp), _compiled_collectives(z1)

    ddp_ar = [c for c, axes in ddp_cs if c.kind == "all-reduce" and axes & DP_AXES]
    # fp32 bytes of the non-scalar arrays (XLA may combine the loss/norm scalars into the same op).
    assert 4 * sum(math.prod(s) for c in ddp_ar for s in c.shapes if math.prod(s) > 1) == buffer_bytes
    assert not [c for c, _ in ddp_cs if c.kind == "reduce-scatter"]

    rs = [c for c, axes in z1_cs if c.kind == "reduce-scatter" and axes & DP_AXES]
    ag = [c for c, axes in z1_cs if c.kind == "all-gather" and axes & DP_AXES]
    assert sum(c.payload_bytes for c in rs) == buffer_bytes  # once, not once per microbatch
    assert sum(c.payload_bytes for c in ag) == buffer_bytes
    z1_ar = [c for c, axes in z1_cs if c.kind == "all-reduce" and axes & DP_AXES]
    assert all(math.prod(s) == 1 for c in z1_ar for s in c.shapes), z1_ar  # only the loss and norm scalars
    # So per device ZeRO-1 sends (d-1)/d B + (d-1)/d B on a ring, DDP's all-reduce 2(d-1)/d B.


@pytest.mark.parametrize("dtype, main_bytes", [("float32", 0), ("bfloat16", 4)])
def test_optimizer_bytes_are_owned_elements_times_state_bytes(dtype, main_bytes):
    zero = {"path": "flat", "bucket_size": 7000}
    cfg = tiny_config("optim_grads", (8, 1, 1), zero=zero, precision={"param_dtype": dtype})
    run = setup(cfg)
    fp = run.zero.flat
    owned = sum(fp.layout.shard_size(b) for b in range(len(fp.layout.bucket_indices)))  # incl. bucket padding
    state = run.init_state()
    per_param = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert per_device_bytes(per_param) == owned * (8 + main_bytes)  # Adam mu + nu (+ fp32 main params)
    assert owned >= fp.layout.owned_numel(0)


def test_flat_refuses_non_elementwise_optimizers():
    cfg = tiny_config()
    run = setup(cfg)
    plan = run.zero.plan
    check_elementwise(run.zero.inner, plan, run.zero.groups)  # adamw with param groups is element-wise
    with pytest.raises(ConfigError, match="element-wise optimizer"):
        check_elementwise(optax.lamb(1e-3), plan)
    masked = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    with pytest.raises(ConfigError, match="element-wise optimizer"):
        check_elementwise(masked, plan)


def test_layout_cli_answers_who_owns_what(capsys):
    argv = ["layout", "--set", "mesh.dp=4", "--set", "mesh.tp=2"]
    argv += ["--set", "zero.bucket_size=100000", "--set", "model.n_layers=2"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["buffer"]["dp_size"] == 4 and d["buffer"]["tp_size"] == 2
    for b in d["buckets"]:
        assert b["numel"] % 128 == 0 and b["shard_size"] * 4 == b["numel"]
    numel = {p["name"]: p["numel"] for p in d["params"]}
    covered = {}
    for r in d["ranks"]:
        for o in r["owned"]:
            covered[o["name"]] = covered.get(o["name"], 0) + o["param"][1] - o["param"][0]
    assert covered == numel  # the ranks' param ranges tile every param
    assert main(argv + ["--rank", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 2 owns" in out and "blocks/1/mlp/fc1/kernel" in out
    assert main(argv + ["--rank", "9"]) == 2
