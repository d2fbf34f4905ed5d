"""Every ZeRO strategy, on both paths, trains the same model to the same numbers as plain
single-device optax (fp32; losses to 1e-5 relative, params per tensor to 1e-4 in norm), and
evaluates the same validation loss."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from helpers import MOE, PATHS, STEPS, assert_matches_reference, grouped_loss, init_state, matrix, tiny_config
from jzero.train.loop import setup
from jzero.train.model import GPTModel

# (dp, ep, tp); dense params on ep > 1 meshes, (2, 2, 2) and (4, 2, 1), are in test_moe.py's MoE
# model, whose attention, embeddings, router and dense block are data-parallel over dp x ep.
MESHES = [(8, 1, 1), (4, 1, 2)]
STRATEGIES = ["no_shard", "optim", "optim_grads"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("strategy, mesh, microbatches, path", matrix(MESHES))
@pytest.mark.matrix
def test_matches_single_device_optax(strategy, mesh, microbatches, path, overlap):
    """overlap: zero.overlap_grad_reduce (and overlap_param_gather, which follows it): each unit's grads
    reduced inside the backward (the flat path's buffers per unit), or every grad after it."""
    zero = {"path": path, "overlap_grad_reduce": overlap}
    assert_matches_reference(tiny_config(strategy, mesh, microbatches, zero=zero))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.slow
def test_tied_embeddings_match(path):
    cfg = tiny_config("optim_grads", (4, 1, 2), 2, model={"tie_embeddings": True}, zero={"path": path})
    assert_matches_reference(cfg)


@pytest.mark.parametrize(
    "strategy, mesh, microbatches, path",
    [
        ("optim_grads", (6, 1, 1), 2, "flat"),
        ("optim_grads", (6, 1, 1), 1, "spec"),
        ("optim", (3, 1, 2), 1, "flat"),
        ("optim_grads", (3, 1, 2), 2, "flat"),
    ],
)
@pytest.mark.slow
def test_dp_not_a_power_of_two(strategy, mesh, microbatches, path):
    """dp = 3 or 6 on 6 of the 8 devices: buckets padded to lcm(dp, 128), sizes that do not divide dp."""
    cfg = tiny_config(strategy, mesh, microbatches, zero={"path": path}, train={"global_batch": 12})
    assert_matches_reference(cfg, devices=jax.devices()[:6])


@pytest.mark.slow
def test_flat_multi_bucket_matches():
    cfg = tiny_config("optim_grads", (4, 1, 2), 2, zero={"path": "flat", "bucket_size": 5000})
    assert_matches_reference(cfg)


@pytest.mark.default_codegen
@pytest.mark.slow
def test_sharded_init_is_bitwise_the_unsharded_init():
    """jzero's init program, whatever the path, strategy, mesh and buckets, makes the params bitwise as
    the model's init alone on one device does (the fidelity tests check it to rounding under the
    suite's faster code generation, where the flat cases below differ in the last bit)."""
    one = {"n_layers": 1}  # one block: laid out as more are (still in many 5000-element buckets)
    offload = {"path": "flat", "offload_fraction": 0.5, "bucket_size": 5000}
    cases = [
        (tiny_config("optim_grads", (6, 1, 1), 2, zero={"path": "flat"}, train={"global_batch": 12}, model=one), 6),
        (tiny_config("optim_grads", (6, 1, 1), 1, zero={"path": "spec"}, train={"global_batch": 12}, model=one), 6),
        (tiny_config("optim_grads", (4, 1, 2), 2, zero={"path": "flat", "bucket_size": 5000}, model=one), 8),
        (tiny_config("optim", (4, 1, 1), zero=offload, model=one), 4),
        (tiny_config("optim_grads_params", (8, 1, 1), zero={"path": "flat"}, model=one), 8),
        (tiny_config("optim", (2, 2, 2), zero={"path": "spec"}, model={"moe": MOE | {"every": 1}, **one}), 8),
    ]
    alone = {}  # the model's init alone on one device, once per model (five cases share one)
    for cfg, n in cases:
        run = setup(cfg, jax.devices()[:n])
        init = jax.device_get(run.zero.full_params(init_state(run).params))
        if (cfg.model, cfg.train.seed) not in alone:
            model = GPTModel(cfg.model, seed=cfg.train.seed)
            on_one = jax.jit(model.init, out_shardings=SingleDeviceSharding(jax.devices()[0]))()
            alone[cfg.model, cfg.train.seed] = jax.device_get(on_one)
        for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(alone[cfg.model, cfg.train.seed]), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{cfg.zero} on {cfg.mesh}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.slow
def test_param_group_rules_match(path):
    """Megatron's param groups with per-name rules: plain optax runs one optax.adamw per group."""
    rules = [
        {"pattern": "tok_emb", "wd_mult": 0.0},
        {"pattern": "mlp", "lr_mult": 0.5},
        {"pattern": "ln1", "wd_mult": 2.0},
    ]
    optimizer = {"lr": 1e-2, "warmup_steps": 2, "param_groups": rules}
    assert_matches_reference(tiny_config("optim_grads", (4, 1, 2), 1, optimizer=optimizer, zero={"path": path}))


@pytest.mark.parametrize(
    "strategy, mesh, dp_outer, microbatches, path, model",
    [
        ("optim_grads_params", (2, 1, 2), 2, 2, "spec", {"scan_layers": True}),  # units gathered, HSDP, stacked
        ("optim_grads", (4, 1, 2), 1, 1, "flat", {}),  # tp-local params, tp_axis
        ("optim", (4, 2, 1), 1, 2, "spec", {"moe": {"num_experts": 4, "every": 2}}),  # no units; ep_axis
    ],
    ids=["zero3-hsdp-scan-spec", "zero2-tp2-flat", "zero1-moe-ep2-spec"],
)
@pytest.mark.matrix
def test_validation_loss_matches_single_device(strategy, mesh, dp_outer, microbatches, path, model):
    """`Zero.evaluate` (the loop's validation loss) is the single-device loss of the same params on the same
    batch: the loss run per rank and microbatch as each path's step runs it, without grads."""
    cfg = tiny_config(strategy, mesh, microbatches, zero={"path": path}, model=model)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp_outer=dp_outer))
    run = setup(cfg)
    rng = np.random.default_rng(0)  # any params will do (no init program to compile): N(0, 0.1^2) each
    params = jax.tree.map(lambda p: rng.normal(0, 0.1, p.shape).astype(p.dtype), run.model.abstract_params())
    got = run.zero.evaluate(run.zero.params_from_model(params), run.device_batch(STEPS))
    groups = (cfg.dp_domain_size, microbatches) if cfg.model.moe.num_experts else (1, 1)  # MoE routes per microbatch
    want = jax.jit(grouped_loss(run.model, groups))(params, run.dataset.batch(STEPS))
    np.testing.assert_allclose(float(got["loss"]), float(want), rtol=1e-5)
