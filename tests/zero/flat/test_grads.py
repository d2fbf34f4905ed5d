"""jzero.zero.flat.grads: the flat path per FSDP unit: each bucket reduced inside the backward (and, where the
params rest as bucket shards, gathered inside the forward) on Megatron's micro-batch schedule; every stage
and schedule trains to single-device optax's numbers, and each phase's hooks do what the phase says."""

import jax
import pytest

from helpers import assert_matches_reference, flat_config
from jzero.train.loop import setup
from jzero.zero.common.schedule import Phase
from jzero.zero.flat.grads import phase_hooks
from jzero.zero.flat.hooks import Mode

SCAN = {"scan_layers": True, "remat": True}
MOE = {"moe": {"num_experts": 4, "top_k": 2, "every": 2, "capacity_factor": 1.0}}


@pytest.mark.parametrize(
    "strategy, mesh, microbatches, dp_outer, model, zero",
    [
        ("optim_grads_params", (4, 1, 2), 2, 1, SCAN, {}),  # ZeRO-3: gathered per unit, twice, every micro-batch
        # (unrolled blocks, a unit each, on dp 8: tests/zero/test_fsdp.py's test_zero3_matches_single_device_optax)
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
        "zero3-tp2-scan-2mb", "zero3-moe-2mb", "zero3-hsdp-optim", "zero1-scan-3mb", "ddp-scan-3mb",
        "zero2-tp2-scan-2mb", "zero2-hsdp", "zero1-hsdp-optim", "zero2-whole-params-2mb", "zero2-moe-whole-params",
        "ddp-tp2", "zero3-off-2mb", "zero1-off-tp2-2mb",
    ],
)  # fmt: skip
@pytest.mark.matrix
def test_every_flat_schedule_matches_single_device_optax(strategy, mesh, microbatches, dp_outer, model, zero):
    assert_matches_reference(flat_config(strategy, mesh, microbatches, dp_outer, model, **zero))




class _Program:
    """What `phase_hooks` reads of a `layout.FlatProgram`."""

    def __init__(self, z, reshard_after_forward=True):
        self.fp, self.options, self.reshard_after_forward = z.flat, z.options, reshard_after_forward


@pytest.mark.parametrize(
    "strategy, phase, mode, flags",
    [
        ("no_shard", Phase.ALIKE, Mode.PARAMS, {"reduce"}),  # DDP: psum, params whole
        ("optim", Phase.MIDDLE, Mode.BUCKET, set()),  # ZeRO-1's middle: accumulate
        ("optim", Phase.FIRST, Mode.SHARD, {"extract", "keep"}),  # ZeRO-1's first
        ("optim", Phase.LAST, Mode.BUCKET, {"reduce"}),  # its last
        ("optim_grads_params", Phase.ALIKE, Mode.SHARD, {"reduce", "reshard"}),  # ZeRO-3
    ],
    ids=["ddp", "zero1-accumulate", "zero1-first", "zero1-last", "zero3"],
)
def test_each_phases_bucket_hooks_follow_it(strategy, phase, mode, flags):
    """A bucket's hook gathers the resting shards only where the phase gathers; ZeRO-1/2 keep the gathered
    bucket for the backward and ZeRO-3 gathers again (`reshard`); only a reducing phase reduces; one hook
    per bucket, each scaling by 1 / (d x M)."""
    run = setup(flat_config(strategy, (8, 1, 1), 2, model=SCAN), with_data=False)
    z = run.zero
    hooks = phase_hooks(_Program(z), phase)
    assert [(h.buf, h.b) for h in hooks] == list(z.flat.buckets)
    assert {h.mode for h in hooks} == {mode}
    assert {h.scale for h in hooks} == {1 / (8 * 2)}
    for h in hooks:
        assert {f for f in ("reduce", "extract", "keep", "reshard") if getattr(h, f)} == flags
    assert len(jax.tree.leaves(z.plan.tensors)) == sum(len(h.shapes) for h in hooks)
