"""Megatron's param groups resolved per param (jzero.zero.common.groups): the defaults, the per-name rules,
scanned layers, and the element-wise transformations that read them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import pytree, tiny_config
from jzero.optim import param_groups
from jzero.train.model import GPTModel
from jzero.zero.common import groups
from jzero.zero.common.groups import ParamGroup
from jzero.zero.common.groups import param_groups as resolve
from jzero.zero.config import ParamGroupRule


def _abstract(**shapes):
    return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


def test_megatron_defaults_no_decay_for_biases_and_1d_params():
    params = _abstract(kernel=(4, 8), bias=(8,), scale=(8,), gain=(), stacked_bias=(3, 8))
    g = resolve(params)
    assert g["kernel"] == ParamGroup(1.0, 1.0)
    assert g["bias"] == g["scale"] == g["gain"] == g["stacked_bias"] == ParamGroup(1.0, 0.0)  # name ends in bias
    decay_all = resolve(params, weight_decay_1d=True)
    assert all(x == ParamGroup() for x in jax.tree.leaves(decay_all, is_leaf=lambda x: isinstance(x, ParamGroup)))


def test_rules_set_only_what_they_give_and_later_rules_win():
    params = {"emb": jax.ShapeDtypeStruct((10, 4), jnp.float32), "blocks": _abstract(kernel=(4, 4), bias=(4,))}
    rules = [
        ParamGroupRule("emb", wd_mult=0.0),
        ParamGroupRule("blocks/", lr_mult=0.5),
        ParamGroupRule("bias$", wd_mult=2.0),
    ]
    g = resolve(params, rules=rules)
    assert g["emb"] == ParamGroup(1.0, 0.0)
    assert g["blocks"]["kernel"] == ParamGroup(0.5, 1.0)
    assert g["blocks"]["bias"] == ParamGroup(0.5, 2.0)


def test_scanned_layers_count_dims_per_layer():
    """With scan_layers a norm scale is [L, D]: still a 1-D param of each layer, so not decayed."""
    for scan in (False, True):
        cfg = tiny_config(model={"scan_layers": scan})
        model = GPTModel(cfg.model)
        groups = param_groups(cfg, model, model.abstract_params())
        ln = groups["blocks"]["ln1"]["scale"] if scan else groups["blocks"][0]["ln1"]["scale"]
        fc1 = groups["blocks"]["mlp"]["fc1"]["kernel"] if scan else groups["blocks"][0]["mlp"]["fc1"]["kernel"]
        assert ln.wd_mult == 0.0 and fc1.wd_mult == 1.0 and groups["tok_emb"].wd_mult == 1.0


def test_optimizers_without_weight_decay_get_no_groups():
    cfg = tiny_config(optimizer={"name": "adam"})
    model = GPTModel(cfg.model)
    assert param_groups(cfg, model, model.abstract_params()) is None


def test_a_pytree_models_groups():
    assert resolve(pytree.abstract()) == {
        "w": ParamGroup(1.0, 1.0),
        "bias": ParamGroup(1.0, 0.0),
        "v": ParamGroup(1.0, 1.0),
        "s": ParamGroup(1.0, 1.0),
    }
    # `ndims` counts a layer's dims: s read as a stack of 1-D params is not decayed, whatever its array's ndim.
    per_layer = resolve(pytree.abstract(), ndims={"w": 2, "bias": 1, "v": 2, "s": 1})
    assert per_layer["s"] == ParamGroup(1.0, 0.0)
    rules = [ParamGroupRule("^s$", lr_mult=0.5), ParamGroupRule("s", wd_mult=0.25)]
    assert resolve(pytree.abstract(), rules=rules)["s"] == ParamGroup(0.5, 0.25)
    assert groups.is_trivial(resolve(pytree.abstract(), weight_decay_1d=True))
    assert not groups.is_trivial(resolve(pytree.abstract()))


def test_adamw_with_every_multiplier_1_is_optax_adamw_bitwise():
    params = pytree.init_params()
    ours, theirs = groups.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
    s1, s2 = ours.init(params), theirs.init(params)
    grad, update1, update2 = jax.jit(jax.grad(pytree.loss)), jax.jit(ours.update), jax.jit(theirs.update)
    for seed in range(3):
        g = grad(params, pytree.batch(seed))
        u1, s1 = update1(g, s1, params)
        u2, s2 = update2(g, s2, params)
        for k in params:
            np.testing.assert_array_equal(u1[k], u2[k])
        params = optax.apply_updates(params, u1)


def test_the_multipliers_scale_decay_and_lr_per_param():
    params = pytree.init_params()
    g = jax.tree.map(jnp.zeros_like, params)  # updates are then the decay alone
    wd = {"w": 0.0, "bias": 2.0, "v": 1.0, "s": 1.0}
    values = groups.GroupValues(jax.tree.map(lambda _: 1.0, wd), wd)
    tx = groups.add_decayed_weights(0.5)
    decayed, _ = tx.update(g, tx.init(params), params, param_groups=values)
    for k in params:
        np.testing.assert_allclose(decayed[k], 0.5 * wd[k] * params[k], rtol=1e-7)
    with pytest.raises(ValueError, match="add_decayed_weights needs the params"):
        tx.update(g, tx.init(params))
    lr = {"w": 0.0, "bias": 3.0, "v": 1.0, "s": 1.0}
    scaled, _ = groups.scale_by_lr_mult().update(params, optax.EmptyState(), param_groups=groups.GroupValues(lr, wd))
    for k in params:
        np.testing.assert_allclose(scaled[k], lr[k] * params[k], rtol=1e-7)


def test_the_multipliers_inside_optax_masked():
    """Inside `optax.masked` the updates hold MaskedNodes where param_groups hold values: before, a pytree
    structure error at build; now the masked-in leaves get their multipliers, the others pass through."""
    params = pytree.init_params()
    g = jax.tree.map(jnp.zeros_like, params)
    wd = {"w": 2.0, "bias": 0.0, "v": 1.0, "s": 1.0}
    values = groups.GroupValues(jax.tree.map(lambda _: 3.0, wd), wd)
    mask = {"w": True, "bias": True, "v": False, "s": False}
    tx = optax.masked(optax.chain(groups.add_decayed_weights(0.5), groups.scale_by_lr_mult()), mask)
    out, _ = tx.update(g, tx.init(params), params, param_groups=values)
    for k in params:
        want = 3.0 * 0.5 * wd[k] * params[k] if mask[k] else g[k]
        np.testing.assert_allclose(out[k], want, rtol=1e-7)
