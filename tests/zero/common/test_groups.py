"""Megatron's param groups resolved per param: the defaults, the per-name rules, scanned layers."""

import jax
import jax.numpy as jnp

from helpers import tiny_config
from jzero.train.loop import param_groups
from jzero.train.model import GPTModel
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
