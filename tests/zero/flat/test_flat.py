"""The explicit flat-buffer path: compiled collectives, exact optimizer bytes, refusals, `jzero layout`,
and the separate expert buffer of a MoE model."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_config
from jzero.cli import main
from jzero.config import ConfigError
from jzero.inspect.compile import abstract_state
from jzero.inspect.hlo import axes_of_groups, parse_collectives
from jzero.train.loop import setup
from jzero.zero.common.probe import check_elementwise
from jzero.zero.flat.buffers import bucket_end_divisor, build_layout
from jzero.zero.memory import per_device_bytes

DP_AXES = {"dp_outer", "dp", "ep"}
# One layout over the whole model, every bucket reduced after the backward: the program these tests pin
# (per-unit buffers, reduced inside the backward: tests/zero/flat/test_hooks.py, test_grads.py).
WHOLE = {"overlap_grad_reduce": False}


def _compiled_collectives(run):
    # The step on the state's shapes and shardings: the program a real state runs (it is never allocated).
    text = run.zero.step.lower(abstract_state(run), run.device_batch(0)).compile().as_text()
    return [(c, set(axes_of_groups(c.replica_groups, run.mesh))) for c in parse_collectives(text)]


@pytest.mark.slow
def test_zero2_step_reduce_scatters_and_all_gathers_the_buffer():
    cfg = tiny_config("optim_grads", (4, 1, 2), zero={"path": "flat", "bucket_size": 5000, **WHOLE})
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
@pytest.mark.matrix
def test_zero1_reduce_scatters_once_with_ddp_wire_bytes(microbatches):
    """Megatron's distributed optimizer: the full local buffer accumulates, one reduce-scatter after
    the last microbatch, one all-gather: DDP's all-reduce bytes (fp32 grads and params)."""
    kw = dict(microbatches=microbatches, zero={"path": "flat", **WHOLE}, train={"global_batch": 32})
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
@pytest.mark.matrix
def test_optimizer_bytes_are_owned_elements_times_state_bytes(dtype, main_bytes):
    zero = {"path": "flat", "bucket_size": 7000, **WHOLE}
    cfg = tiny_config("optim_grads", (8, 1, 1), zero=zero, precision={"param_dtype": dtype})
    run = setup(cfg)
    fp = run.zero.flat
    owned = sum(fp.layout.shard_size(b) for b in range(len(fp.layout.bucket_indices)))  # incl. bucket padding
    state = run.init_state()
    per_param = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert per_device_bytes(per_param) == owned * (8 + main_bytes)  # Adam mu + nu (+ fp32 main params)
    assert owned >= fp.layout.owned_numel(0)


@pytest.mark.slow
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
    argv = ["layout", "--set", "mesh.dp=4", "--set", "mesh.tp=2", "--set", "zero.overlap_grad_reduce=false"]
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


# ---------------------------------------------------------------- expert buffer

MOE = {"num_experts": 6, "top_k": 2, "every": 2, "capacity_factor": 1.0}


def _moe_run(strategy="optim_grads", mesh=(2, 3, 1), num_experts=6, zero=None, **sections):
    """A MoE run on the flat path on dp * ep * tp devices; by default dp=2, ep=3 on 6 devices: the
    dense DP size 6 pads buckets to lcm(6, 128) = 384, the expert DP size 2 to 128."""
    dp, ep, tp = mesh
    cfg = tiny_config(
        strategy,
        mesh,
        zero={"path": "flat", **WHOLE} | (zero or {}),
        model={"moe": MOE | {"num_experts": num_experts}},
        train={"global_batch": 12},
        **sections,
    )
    return setup(cfg, devices=jax.devices()[: dp * ep * tp], with_data=False)


def test_moe_has_a_dense_and_an_expert_buffer_each_padded_for_its_dp_size():
    run = _moe_run()
    fp = run.zero.flat
    dense, expert = fp.buffers
    assert (dense.kind, dense.d, dense.layout.dp_size) == ("dense", 6, 6)
    assert (expert.kind, expert.d, expert.layout.dp_size) == ("expert", 2, 2)
    tensors = jax.tree.leaves(fp.plan.tensors)
    assert {tensors[i].name for i in expert.params} == {t.name for t in tensors if "/experts/" in t.name}
    assert sorted(dense.params + expert.params) == list(range(len(tensors)))
    for buf, divisor in ((dense, 384), (expert, 128)):
        assert bucket_end_divisor(buf.layout.dp_size) == divisor
        assert all((end - start) % divisor == 0 for start, end in buf.layout.bucket_indices)
        # Megatron's layout over the buffer's own (ep- and tp-local) params and DP size.
        numels = [math.prod(fp.local_shapes[i]) for i in buf.params]
        assert buf.layout == build_layout(numels, buf.layout.dp_size)
    for i in expert.params:
        assert fp.local_shapes[i][0] == MOE["num_experts"] // 3  # this ep rank's experts
    assert fp.n_buckets == 2 and fp.numel == dense.layout.numel + expert.layout.numel
    assert fp.bucket_shapes() == [(1, dense.layout.numel), (3, expert.layout.numel)]  # [tp, S], [ep * tp, S]
    assert [s.sharding.spec for s in run.zero.grad_buffer_structs(jnp.float32)] == [
        jax.sharding.PartitionSpec("tp", ("dp_outer", "dp", "ep")),
        jax.sharding.PartitionSpec(("ep", "tp"), ("dp_outer", "dp")),
    ]
    # A dense model keeps its one buffer: no empty expert buffer.
    dense = tiny_config(zero={"path": "flat", **WHOLE})
    assert [b.kind for b in setup(dense, with_data=False).zero.flat.buffers] == ["dense"]


@pytest.mark.slow
def test_expert_state_per_device_is_one_edp_th_of_the_local_experts():
    run = _moe_run("optim", (2, 2, 2), num_experts=4, zero={"bucket_size": 3000})
    fp = run.zero.flat
    expert = fp.buffer("expert")
    first = fp.buffer("dense").n_buckets  # plan buckets: dense first
    assert expert.n_buckets > 1
    state = run.init_state()
    moments = 0
    for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state.inner_state)[0]:
        if x.ndim and path[-1].idx >= first:  # Adam's mu and nu of an expert bucket
            start, end = expert.layout.bucket_indices[path[-1].idx - first]
            assert x.shape == (2 * 2, end - start)  # [ep * tp, S_b]
            assert x.sharding.shard_shape(x.shape) == (1, (end - start) // 2)  # 1/edp of the local experts' bucket
            moments += 1
    assert moments == 2 * expert.n_buckets
    local_experts = sum(math.prod(fp.local_shapes[i]) for i in expert.params)
    assert expert.layout.numel - local_experts < 64 * len(expert.params) + 128 * expert.n_buckets  # gaps, padding


@pytest.mark.slow
def test_expert_state_round_trips_through_model_space():
    """to_model_space(from_model_space(x)) == x for any model-space state (every expert, tp-split
    and tp-replicated params), and the fp32 main params the flat init laid out per device read back
    as the model's params: the conversion is the layout the step uses."""
    run = _moe_run("optim_grads", (2, 2, 2), 4, {"bucket_size": 3000}, precision={"param_dtype": "bfloat16"})
    state = run.init_state()
    model = jax.jit(run.zero.to_model_space)(state.opt_state)
    for m, p in zip(jax.tree.leaves(model.main_params), jax.tree.leaves(run.zero.full_params(state.params))):
        np.testing.assert_array_equal(m, np.asarray(p, np.float32))
    rng = np.random.default_rng(0)
    x = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype) if a.ndim else a, model)
    back = jax.jit(lambda s: run.zero.to_model_space(run.zero.from_model_space(s)))(x)
    assert jax.tree.structure(back) == jax.tree.structure(x)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(x)):
        np.testing.assert_array_equal(a, b)


def test_layout_cli_shows_the_expert_buffer_over_the_expert_dp_domain(capsys):
    argv = ["layout", "--set", "mesh.dp=2", "--set", "mesh.ep=2", "--set", "mesh.tp=2", "--set", "model.n_layers=2"]
    argv += ["--set", "zero.overlap_grad_reduce=false"]
    argv += ["--set", "model.moe.num_experts=4", "--set", "model.moe.every=2"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    dense, expert = d, d["expert"]
    assert (dense["buffer"]["kind"], dense["buffer"]["dp_size"]) == ("dense", 4)
    assert (expert["buffer"]["kind"], expert["buffer"]["dp_size"]) == ("expert", 2)
    assert not any("/experts/" in p["name"] for p in dense["params"])
    for buf in (dense, expert):
        covered = {}
        for r in buf["ranks"]:
            for o in r["owned"]:
                covered[o["name"]] = covered.get(o["name"], 0) + o["param"][1] - o["param"][0]
        assert covered == {p["name"]: p["numel"] for p in buf["params"]}  # the ranks' ranges tile every param
    assert main(argv + ["--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "buffer: expert" in out and "rank 1 (dense rank 3" in out and "blocks/1/mlp/experts/fc1/kernel" in out
