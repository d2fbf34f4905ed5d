"""The spec path's overlapping schedule (`jzero/zero/spec/grads.py`): every micro-batch schedule trains
to single-device optax's numbers, with overlap on and off, and the collectives sit where Megatron's
overlap puts them (inside the backward, one param gather per step)."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import reference_run, rel_param_errors, run_steps, tiny_config
from helpers.programs import needs_gpu_plugin
from jzero.config import validate
from jzero.inspect import hlo, overlap
from jzero.inspect.compile import compile_step
from jzero.train.loop import setup
from jzero.zero.memory import formula_split, per_device_bytes

SCAN = {"scan_layers": True, "remat": True}  # stacked units inside a scan, recomputed in backward


def assert_matches(cfg):
    _, ref_losses, ref_norms, ref_params = reference_run(cfg)
    _, _, losses, norms, state = run_steps(cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
    errors = rel_param_errors(state.params, ref_params)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: {errors[worst]:.2e}"
    return state


@pytest.mark.parametrize(
    "strategy, microbatches, mesh, dp_outer, model, overlap",
    [
        # ZeRO-1 over 3 micro-batches: the first gathers the params and hands them on, the second only
        # accumulates, the last adds the carry and reduce-scatters per unit; stacked units, recomputed.
        ("optim", 3, (8, 1, 1), 1, SCAN, True),
        ("optim_grads", 2, (4, 1, 2), 1, SCAN, True),  # ZeRO-2: gathered once, reduced every micro-batch
        ("no_shard", 3, (8, 1, 1), 1, SCAN, True),  # DDP: all-reduced per unit in the last backward
        ("optim", 2, (4, 1, 1), 2, {}, True),  # HSDP: inside dp, then across dp_outer, per unit
        ("no_shard", 2, (2, 1, 2), 2, SCAN, True),  # DDP under HSDP: hierarchical all-reduce, tp-local blocks
        ("optim", 2, (8, 1, 1), 1, SCAN, False),  # overlap off: the reduction after the backward
        ("optim_grads", 2, (4, 1, 2), 1, SCAN, False),
        ("no_shard", 1, (8, 1, 1), 1, {}, False),
    ],
    ids=["zero1-3mb-scan", "zero2-2mb-tp2-scan", "ddp-3mb-scan", "zero1-hsdp", "ddp-hsdp-tp2-scan", "off-zero1",
         "off-zero2", "off-ddp"],  # fmt: skip
)
@pytest.mark.matrix
def test_every_schedule_matches_single_device_optax(strategy, microbatches, mesh, dp_outer, model, overlap):
    cfg = tiny_config(
        strategy, mesh, microbatches, model=model, zero={"overlap_grad_reduce": overlap},
        train={"global_batch": 24 if microbatches == 3 else 16},
    )  # fmt: skip
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp_outer=dp_outer))
    validate(cfg)
    assert_matches(cfg)


@pytest.mark.slow
def test_params_rest_sharded_and_read_whole():
    """ZeRO-2 with overlap_param_gather: the step leaves the params split over DP (1/d of them per
    device), a user reading `state.params` gets the whole values, and `evaluate` gives the step's loss."""
    cfg = tiny_config("optim_grads", precision={"param_dtype": "bfloat16"})
    run = setup(cfg)
    state = run.init_state()
    off = setup(tiny_config("optim_grads", precision={"param_dtype": "bfloat16"}, zero={"overlap_grad_reduce": False}))
    full = off.init_state()
    n = sum(x.size for x in jax.tree.leaves(state.params))
    assert per_device_bytes(full.params) == 2 * n  # without overlap: the bf16 model copy replicated
    rests = per_device_bytes(state.params)  # split over dp as ZeRO-3's (a dim of 257 stays whole)
    assert rests == formula_split(run.zero)["params"] and rests < 2 * n / 4
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(full.params))):
        np.testing.assert_array_equal(a, b)
    batch = run.device_batch(0)
    loss = float(run.zero.evaluate(state.params, batch)["loss"])
    _, metrics = run.zero.step(state, batch)
    assert loss == pytest.approx(float(metrics["loss"]), rel=1e-6)


def _per_step_payload(c, kind) -> float:
    """Bytes per step of the DP collectives of `kind`: each instruction x the runs of its loop."""
    sch = overlap.read_schedule(c.compiled.as_text())
    rows = [o for o in sch.overlaps if o.collective.kind == kind]
    on_dp = [o for o in rows if hlo.axes_of_groups(o.collective.replica_groups, c.run.mesh) == ("dp",)]
    return sum(o.collective.payload_bytes * o.runs for o in on_dp)


@pytest.mark.slow  # two compiles for collectives: the fast subset's spec-path checks are its fidelity tests
def test_zero1_reduce_scatters_per_unit_and_gathers_once():
    """ZeRO-1 of a scanned model on CPU: the grads leave as explicit reduce-scatters (per unit, in the
    last backward; XLA:CPU emits no reduce-scatter of its own) moving one set of grads, and the params
    are all-gathered once per step, with one micro-batch or two."""
    for microbatches in (1, 2):
        cfg = tiny_config("optim", microbatches=microbatches, model=SCAN, train={"global_batch": 16})
        c = compile_step(cfg, dump=False)
        n = sum(t.numel for t in jax.tree.leaves(c.run.zero.plan.tensors))
        assert _per_step_payload(c, "reduce-scatter") == pytest.approx(4 * n, rel=0.01), microbatches  # fp32, once
        assert _per_step_payload(c, "all-gather") == pytest.approx(4 * n, rel=0.01), microbatches
        assert _per_step_payload(c, "all-reduce") < 1024  # the loss and norm scalars only


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", pytest.param("h100", marks=needs_gpu_plugin)])
def test_zero2_reduce_scatters_every_micro_batch(target):
    """ZeRO-2 with two micro-batches: each one's grads are reduce-scattered in its own backward (two
    sets of grads on the wire, never a whole local grad buffer), though XLA could sum the first's
    shard into the second's reduce-scatter (its reduce-scatter reassociation) once the one-step scan
    of the later micro-batches is unrolled."""
    cfg = tiny_config("optim_grads", microbatches=2, model=SCAN, train={"global_batch": 16})
    c = compile_step(cfg, target, "1 x 1 x 8" if target == "h100" else None, dump=False)
    n = sum(t.numel for t in jax.tree.leaves(c.run.zero.plan.tensors))
    assert _per_step_payload(c, "reduce-scatter") == pytest.approx(2 * 4 * n, rel=0.01)
    assert _per_step_payload(c, "all-gather") == pytest.approx(4 * n, rel=0.01)


def test_hooks_follow_the_phase():
    """`unit_hooks`: DDP all-reduces (no shard dim; under HSDP hierarchically, on the shard dim), ZeRO-1
    reduce-scatters on the plan's shard dim; a micro-batch that only accumulates reduces nothing; only
    params resting sharded are gathered, and ZeRO-1/2 keep what they gathered for the backward (ZeRO-3
    gathers again)."""
    from jzero.zero.spec.grads import Phase, unit_hooks

    def hooks(strategy, phase, **zero):
        run = setup(tiny_config(strategy, zero=zero))
        return jax.tree.leaves(unit_hooks(run.zero.plan, run.zero.options, True, phase)), run.zero.plan

    ddp, _ = hooks("no_shard", Phase.ALIKE)
    assert all(h.dim is None and h.reduce and not h.gathers and not h.regather for h in ddp)
    cfg = tiny_config("no_shard", (4, 1, 1))
    run = setup(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp_outer=2)))
    hsdp = jax.tree.leaves(unit_hooks(run.zero.plan, run.zero.options, True, Phase.ALIKE))
    tensors = jax.tree.leaves(run.zero.plan.tensors)
    assert all(h.regather == (h.dim is not None) == (t.shard_dim is not None) for h, t in zip(hsdp, tensors))
    assert any(h.regather for h in hsdp) and all(h.outer == ("dp_outer",) and "dp" in h.inner for h in hsdp)
    zero1, plan = hooks("optim", Phase.FIRST)
    tensors = jax.tree.leaves(plan.tensors)
    assert all((h.dim is None) == (t.shard_dim is None) for h, t in zip(zero1, tensors))
    assert all(not h.reduce and h.extract for h in zero1)
    assert all(h.gathers == (t.shard_dim is not None) and h.keep == h.gathers and not h.reshard
               for h, t in zip(zero1, tensors))  # fmt: skip
    zero3, _ = hooks("optim_grads_params", Phase.ALIKE)
    assert all(h.reshard == h.gathers and not h.keep for h in zero3)
    resting, _ = hooks("optim", Phase.ALIKE, overlap_grad_reduce=False)
    assert not any(h.gathers for h in resting)  # without overlap_param_gather the params rest whole
