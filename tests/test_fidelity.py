"""Every ZeRO strategy trains the same model to the same numbers as plain single-device optax."""

import jax
import numpy as np
import pytest

from helpers import STEPS, reference_run, rel_param_errors, run_steps, tiny_config

MESHES = [(8, 1, 1), (4, 1, 2), (2, 2, 2)]  # (dp, ep, tp)
STRATEGIES = ["no_shard", "optim", "optim_grads"]


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "dp%d-ep%d-tp%d" % m)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_single_device_optax(strategy, mesh, microbatches):
    cfg = tiny_config(strategy, mesh, microbatches)
    ref_init, ref_losses, ref_norms, ref_params = reference_run(tiny_config())
    _, init, losses, norms, state = run_steps(cfg)

    # Sharded init is bitwise the unsharded init.
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(ref_init)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
    errors = rel_param_errors(state.params, ref_params)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: {errors[worst]:.2e}"
    assert len(losses) == STEPS


def test_tied_embeddings_match():
    cfg = tiny_config("optim_grads", (4, 1, 2), 2, model={"tie_embeddings": True})
    _, ref_losses, _, ref_params = reference_run(cfg)
    _, _, losses, _, state = run_steps(cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max(rel_param_errors(state.params, ref_params).values()) < 1e-4
