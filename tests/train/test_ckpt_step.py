"""jzero.train.ckpt_step: a saved step's arrays as nested dicts named by path, and the fit check a restore
makes against them (no files: the items as the Checkpointer hands them to orbax)."""

import os
import threading

import jax
import jax.numpy as jnp
import optax
import pytest

from jzero.errors import CheckpointError
from jzero.train import ckpt_dir
from jzero.train.ckpt_step import check_fits, from_nested, names, read_meta, to_nested


def state():
    params = {"blocks": [{"w": jnp.ones((4, 2))}, {"w": jnp.zeros((4, 2))}], "bias": jnp.arange(3.0)}
    return {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": jnp.int32(7)}


def test_nested_dicts_round_trip_and_name_every_array_by_its_path():
    tree = state()
    nested = to_nested(tree)
    assert sorted(names(nested)) == sorted(
        ["params/bias", "params/blocks/0/w", "params/blocks/1/w", "step", "opt_state/0/count"]
        + [f"opt_state/0/{m}/{p}" for m in ("mu", "nu") for p in ("bias", "blocks/0/w", "blocks/1/w")]
    )
    back = from_nested(nested, tree)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        assert a is b


def meta_of(tree) -> dict:
    return {"arrays": {n: {"shape": list(x.shape), "dtype": str(x.dtype)} for n, x in names(to_nested(tree)).items()}}


def test_a_step_fits_a_model_of_its_shapes_and_dtypes_whatever_its_step():
    target = to_nested(jax.eval_shape(state))
    check_fits(6, "ck", meta_of(state()), target)
    wider = state()
    wider["params"]["blocks"][1]["w"] = jnp.zeros((4, 3))
    with pytest.raises(CheckpointError) as e:
        check_fits(6, "ck", meta_of(wider), target)
    assert str(e.value) == (
        "checkpoint step 6 in ck does not fit the model (1 arrays): "
        "params/blocks/1/w: checkpoint [4, 3] vs model [4, 2]"
    )
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state())
    with pytest.raises(CheckpointError) as e:
        check_fits(6, "ck", meta_of(half), target)
    assert str(e.value).startswith("checkpoint step 6 in ck: dtypes differ (")
    assert "opt_state/0/mu/bias: checkpoint bfloat16 vs model float32" in str(e.value)
    assert str(e.value).endswith("(set precision.param_dtype and optimizer.moments_dtype as the run that saved it did)")
    moments = {**state(), "opt_state": half["opt_state"]}  # optimizer.moments_dtype=bfloat16 alone
    with pytest.raises(CheckpointError, match=r"\(set optimizer.moments_dtype as the run that saved it did\)$"):
        check_fits(6, "ck", meta_of(moments), target)
    kept = {**state(), "main_params": state()["params"]}  # a bf16 run's checkpoint, its fp32 main params beside
    with pytest.raises(CheckpointError, match=r"main_params/blocks/1/w: checkpoint \[4, 2\] vs model absent.* \(fp32 "
                       r"main params are kept only for params below float32, a loss scaler's state only for float16: "
                       r"set precision.param_dtype as the run"):  # fmt: skip
        check_fits(6, "ck", meta_of(kept), target)
    scaled = {**state(), "grad_scaler": {"loss_scale": jnp.zeros(())}}  # fp16's, into a bf16 or fp32 run
    with pytest.raises(CheckpointError, match=r"grad_scaler/loss_scale: checkpoint \[\] vs model absent \(fp32 main "
                       r"params .* a loss scaler's state only for float16: set precision.param_dtype"):  # fmt: skip
        check_fits(6, "ck", meta_of(scaled), target)


def test_a_fifo_as_the_metadata_is_a_damaged_step_not_a_hang(tmp_path):
    """Reading a named pipe blocks until something writes to it: forever; a step whose meta is one is damaged."""
    step = tmp_path / "step_00000002"
    (step / "state").mkdir(parents=True)
    (step / "meta").mkdir()
    os.mkfifo(step / "meta" / "metadata")
    errors, found = [], []

    def read():
        found.append(ckpt_dir.is_step(step))
        try:
            read_meta(tmp_path, 2)
        except CheckpointError as e:
            errors.append(str(e))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "reading the FIFO blocked"
    assert found == [True]  # jzero's two items, meta unreadable: a damaged step, which restoring reports
    assert errors == [
        f"checkpoint step 2 in {tmp_path}: unreadable ({step}/meta/metadata is not a regular file: a FIFO or device "
        "would block the read)"
    ]
