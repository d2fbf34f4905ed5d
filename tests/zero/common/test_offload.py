"""Optimizer-state host offload (`zero.offload_fraction`, jzero/zero/common/offload.py): it moves bytes, not
math, and the bytes it moves are where the shardings, the compiled program and Megatron's formula
say. Checkpoints moving between fractions: test_checkpoint.py."""

import json

import jax
import optax
import pytest

from helpers import assert_matches_reference, pytree, tiny_config
from helpers.commands import TINY, jzero, needs_cuda
from jzero.config import ConfigError, load_config
from jzero.train.loop import setup
from jzero.zero.common.offload import HOST, choose, spec_offload
from jzero.zero.common.strategies import make_plan, path_name
from jzero.zero.config import ShardingStrategy
from jzero.zero.spec.optimizer import opt_state_shardings


def test_choose_is_megatrons_rule():
    """A unit is offloaded while the elements offloaded before it are below fraction x total."""
    assert choose([4, 4, 4, 4], 0.0) == [False] * 4
    assert choose([4, 4, 4, 4], 0.5) == [True, True, False, False]
    assert choose([4, 4, 4, 4], 0.3) == [True, True, False, False]  # the last one overshoots
    assert choose([1, 10, 1], 0.5) == [True, True, False]
    assert choose([4, 4, 4, 4], 1.0) == [True] * 4


def test_fraction_outside_0_1_is_one_line():
    with pytest.raises(ConfigError, match=r"^zero.offload_fraction=1.5 must be in \[0, 1\]$"):
        load_config(None, ["zero.offload_fraction=1.5"])


@pytest.mark.parametrize("path, strategy, fraction", [("spec", "optim_grads", 1.0), ("flat", "optim", 0.5)])
@pytest.mark.matrix
def test_offloaded_runs_match_single_device_optax(path, strategy, fraction):
    """Fidelity tolerances (test_fidelity.py). Fraction 0 is the program without offload, tested there;
    0.5 and 1 differ in which leaves the step copies, not in how: each path runs one of them here (the
    flat run's 5 buckets make 0.5 a part), the other in test_host_bytes_... (spec 0.5, compiled) and
    test_checkpoint.py (flat 1.0, trained bitwise like no offload)."""
    zero = {"path": path, "offload_fraction": fraction, "bucket_size": 5000 if path == "flat" else None}
    cfg = tiny_config(strategy, (4, 1, 1), zero=zero)
    offload = setup(cfg, jax.devices()[:4]).zero.offload
    assert offload.active and (offload.offloaded_numel < offload.total_numel) == (fraction < 1)
    assert_matches_reference(cfg, devices=jax.devices()[:4])


def test_fraction_zero_has_no_memory_kinds():
    run = setup(tiny_config("optim_grads", (8, 1, 1)))
    assert not run.zero.offload.active
    assert HOST not in {s.memory_kind for s in jax.tree.leaves(run.zero.shardings)}
    state = jax.eval_shape(run.init_state)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, run.zero.shardings)
    batch = jax.ShapeDtypeStruct((16, 17), jax.numpy.int32, sharding=run.zero.batch_sharding)
    assert "memory_kind" not in run.zero.step.lower(state, batch).as_text()


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100", marks=needs_cuda)])
@pytest.mark.matrix
def test_host_bytes_of_the_compiled_program_are_the_formula(tmp_path, target):
    """bf16 params, ZeRO-2, half the state offloaded: the host bytes of the shardings are Megatron's
    formula's share, and the compiled program takes and returns exactly those in host memory (S(5));
    its device arguments are the rest of the state, the step counters and the batch."""
    out = tmp_path / "memory.json"
    argv = ["memory", "--target", target, "--strategies", "optim_grads", "--json", str(out)]
    assert jzero(argv, [*TINY, "precision.param_dtype=bfloat16", "zero.offload_fraction=0.5"]) == 0
    s = json.loads(out.read_text())["strategies"]["optim_grads"]
    state, host, c = s["state"], s["host"]["state"], s["compiled"]
    assert host == pytest.approx(s["host"]["formula"], rel=1e-12)
    assert 0 < host["main_params"] < state["main_params"] and 0 < host["optimizer_moments"] < state["optimizer_moments"]
    assert c["host_argument"] == c["host_output"] == c["host_alias"] == host["total"]
    device_state = state["params"] + state["main_params"] + state["optimizer_moments"] - host["total"]
    assert c["argument"] == device_state + 4 + 32 * 17 * 4 // 8  # the step counter, this device's batch


def test_spec_offload_takes_whole_params_in_leaves_order():
    """The pytree model on dp 4 under ZeRO-1, in leaves order bias, s, v, w: each device steps 6 (bias stays
    replicated), 30, 18 and 24 elements of the main params. Half of the 78: bias, s and v (54) are offloaded,
    Megatron's rule letting the last overshoot; their main params and Adam's moments, never the step count."""
    plan = make_plan(pytree.mesh(dp=4), ShardingStrategy.OPTIM, pytree.abstract(), pytree.NO_TP)
    inner = optax.adam(1e-2)
    shardings = opt_state_shardings(inner, plan, quantized_gather=True)  # with fp32 main params
    offload = spec_offload(plan, inner, shardings, 0.5)
    assert offload.units == ("bias", "s", "v") and offload.params == {0, 1, 2}
    assert (offload.offloaded_numel, offload.total_numel) == (54, 78)
    assert offload.mask.main_params == {"bias": True, "s": True, "v": True, "w": False}
    for path, host in jax.tree_util.tree_flatten_with_path(offload.mask.inner_state)[0]:
        name = path_name(path)
        assert host == (name.split("/")[-1] in ("bias", "s", "v") and "count" not in name), name
    host_shardings = offload.shardings(shardings)
    for s, host in zip(jax.tree.leaves(host_shardings), jax.tree.leaves(offload.mask)):
        assert (s.memory_kind == HOST) == host
    assert not spec_offload(plan, inner, shardings, 0.0).active
