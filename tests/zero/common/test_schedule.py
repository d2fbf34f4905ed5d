"""jzero.zero.common.schedule: Megatron's micro-batch schedule with overlap, which both paths share: which
micro-batch gathers, reduces, hands its gathered params on or only accumulates, and the grads summed."""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from helpers.programs import needs_gpu_plugin
from jzero.inspect.compile import compile_step
from jzero.inspect.hlo_module import Module
from jzero.zero.common.schedule import run_schedule
from jzero.zero.config import Stage

SCAN = {"scan_layers": True, "remat": True}  # stacked layers inside a scan, recomputed in backward


class Phase(NamedTuple):
    """What a `schedule.Phase` does in a stage."""

    gather: bool
    reduce: bool
    extract: bool = False
    acc: bool = False
    stacked: bool = False


def _schedule(m, gather, shards_grads, shards_params):
    """The phases `run_schedule` traces over `m` micro-batches, in order (the micro-batches a scan runs
    alike are traced once), and the grads it returns, of a `run` whose grads are the micro-batch's value.
    gather: the params rest sharded."""
    strategy = "optim_grads_params" if shards_params else "optim_grads" if shards_grads else "optim"
    stage = Stage.of(strategy, overlap_param_gather=gather)
    assert (stage.params_rest_sharded, stage.shards_grads, stage.shards_params) == (gather, shards_grads, shards_params)
    phases = []
    resting, gathered = (jnp.zeros(()),), (jnp.zeros(()), jnp.zeros(()))  # told apart by their length

    def run(role, params, mb, acc=None):
        phase = Phase(role.gathers(stage), role.reduces(stage), role.extracts(stage), role.adds_carry,
                      role.stacked(stage))  # fmt: skip
        assert phase.stacked == (len(params) == len(gathered))
        phases.append(phase)
        g = mb + (acc if phase.acc else 0.0)
        return mb * 0.0, {"m": mb}, g, gathered if phase.extract else None

    mbs = jnp.arange(1.0, m + 1)
    losses, metrics, g = run_schedule(run, resting, mbs, stage, zeros=lambda: jnp.zeros(()))
    assert losses.shape == (m,) and metrics["m"].shape == (m,)
    np.testing.assert_array_equal(metrics["m"], mbs)  # every micro-batch once, in order
    return phases, float(g)


@pytest.mark.parametrize("gather", [False, True])
def test_ddp_and_zero1_accumulate_then_reduce_once_in_the_last(gather):
    """DDP / ZeRO-1 over 3 micro-batches: none reduces but the last, which adds the carry; with params
    resting sharded the first gathers and hands them on (extract), the others take what it gave."""
    phases, g = _schedule(3, gather, shards_grads=False, shards_params=False)
    assert [p.reduce for p in phases] == [False, False, True]
    assert phases[-1].acc and not any(p.acc for p in phases[:-1])
    assert [p.gather for p in phases] == [gather, False, False]
    assert [p.extract for p in phases] == [gather, False, False]
    assert [p.stacked for p in phases] == [False, gather, gather]
    assert g == 1 + 2 + 3


def test_zero2_reduces_every_micro_batch_and_gathers_once():
    phases, g = _schedule(3, True, shards_grads=True, shards_params=False)
    assert all(p.reduce for p in phases) and not any(p.acc for p in phases)
    assert [p.gather for p in phases] == [True, False] and phases[0].extract  # the later two in one scan
    assert phases[1].stacked
    assert g == 6


@pytest.mark.parametrize("m", [1, 3])
def test_zero3_runs_every_micro_batch_alike(m):
    """ZeRO-3 gathers and reduces in every micro-batch (its params are never handed on)."""
    phases, g = _schedule(m, True, shards_grads=True, shards_params=True)
    assert set(phases) == {Phase(gather=True, reduce=True)}
    assert g == sum(range(1, m + 1))


def test_one_micro_batch_reduces_without_a_carry():
    phases, g = _schedule(1, False, shards_grads=False, shards_params=False)
    assert phases == [Phase(gather=False, reduce=True)] and g == 1


@pytest.mark.slow
@needs_gpu_plugin
@pytest.mark.parametrize("path", ["spec", "flat"])
def test_zero3_micro_batch_loop_is_not_peeled_on_a_gpu(path):
    """ZeRO-3 over 3 micro-batches, compiled for 8 H100s: every gather stays inside the micro-batch loop.
    Without the scan's barrier XLA's collective pipeliner starts a micro-batch's first gathers in the one
    before by peeling a micro-batch out of the loop (its layer loops and gathers then sit in the entry
    computation), and its zero-initialised grad stack stays live across the loop (7B: +7.4 GiB)."""
    cfg = tiny_config("optim_grads_params", microbatches=3, model=SCAN, zero={"path": path}, train={"global_batch": 24})
    m = Module(compile_step(cfg, "h100", "1 x 1 x 8", dump=False).compiled.as_text())
    entry = m.computations[m.entry]
    assert [i.opcode for i in entry if i.opcode == "while"] == ["while"]  # the micro-batch loop alone
    assert not [i.name for i in entry if i.opcode == "all-gather-start"]
