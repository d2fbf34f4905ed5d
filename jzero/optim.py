"""The config's `optimizer:` and `precision:` sections as what `build_zero` takes: the learning-rate
schedule, the optax chain (element-wise, Megatron's Muon, or any optax optimizer by name), Megatron's
param groups and fp16's dynamic loss scaling."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jzero.config import Config, ConfigError, DType, MomentsDType, OptimizerName, loss_scale
from jzero.config_checks import OPTAX_KEY, optax_function
from jzero.errors import one_line
from jzero.model import Model
from jzero.zero import groups
from jzero.zero.common.moments import store_state_in
from jzero.zero.config import DynamicLossScale


def lr_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to `optimizer.lr`, then cosine decay to 10% of it at `train.steps`."""
    o = cfg.optimizer
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=max(cfg.train.steps, o.warmup_steps + 1),
        end_value=0.1 * o.lr,
    )


def inner_optimizer(cfg: Config, model: Model | None = None) -> optax.GradientTransformation:
    """The optax chain the ZeRO wrapper shards (clipping lives in the wrapper).

    optax's own `sgd`, `adam` and `adamw` chains, with jzero's param-group pieces: the
    weight decay reads each param's `wd_mult`, a last step its `lr_mult`; or Megatron's Muon
    (`groups.muon`, which reads both itself; `model` gives its params' stacked layer dims); or the
    optax optimizer `optimizer.optax` names (`optax_by_name`). With `optimizer.moments_dtype: bfloat16`
    its state is stored in bf16 (`zero.moments`).
    """
    o, lr = cfg.optimizer, lr_schedule(cfg)
    if o.name == OptimizerName.ADAMW:
        chain = groups.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    elif o.name == OptimizerName.MUON:
        chain = muon(cfg, lr, model)
    elif o.name == OptimizerName.OPTAX:
        chain = optax_by_name(cfg, lr)
    else:
        if o.name == OptimizerName.SGD:
            direction = optax.trace(decay=o.b1) if o.b1 else optax.identity()
        else:
            direction = optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)
        chain = optax.chain(direction, optax.scale_by_learning_rate(lr), groups.scale_by_lr_mult())
    if o.moments_dtype == MomentsDType.FLOAT32:
        return chain
    return store_state_in(chain, jnp.dtype(o.moments_dtype.value))


def optax_by_name(cfg: Config, lr: optax.Schedule) -> optax.GradientTransformation:
    """The optimizer `optimizer.optax.name` names, called with `optimizer.optax.args` and `lr` as its
    `learning_rate` (one without that argument is followed by `optax.scale_by_learning_rate(lr)`), then
    each param's `lr_mult` (`groups.scale_by_lr_mult`). Its weight decay is its own (`args`): it reads no
    `wd_mult`. ConfigError naming the key when the call fails or returns no optax transformation."""
    x = cfg.optimizer.optax
    fn, takes_lr = optax_function(x.name)
    try:
        tx = fn(learning_rate=lr, **x.args) if takes_lr else fn(**x.args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{OPTAX_KEY}={x.name!r} with optimizer.optax.args: {one_line(e)}") from None
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(f"{OPTAX_KEY}={x.name!r} returned a {type(tx).__name__}, not an optax GradientTransformation")
    steps = [tx] if takes_lr else [tx, optax.scale_by_learning_rate(lr)]
    return optax.chain(*steps, groups.scale_by_lr_mult())


def muon(cfg: Config, lr: optax.Schedule, model: Model | None) -> optax.GradientTransformation:
    """`groups.muon` with `optimizer`'s keys; Newton-Schulz runs per layer of a stacked [L, ...] param and
    per expert of an [E, ...] one (the dims `model.layer_ndims` leaves out), on the matrices the model
    names (`muon_matrices`, if it has one: jzero's GPT's split QKV and multi-dim kernels)."""
    o, m = cfg.optimizer, cfg.optimizer.muon
    layer_dims = matrices = None
    if model is not None:
        abstract = model.abstract_params()
        layer_dims = jax.tree.map(lambda p, n: len(p.shape) - n, abstract, model.layer_ndims(abstract))
        if hasattr(model, "muon_matrices"):  # a model with fused or multi-dim kernels (jzero's GPT)
            matrices = model.muon_matrices(abstract)
    return groups.muon(
        lr,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_steps=m.ns_steps,
        ns_dtype=jnp.dtype(m.ns_dtype.value),
        scale_mode=m.scale_mode.value,
        extra_scale_factor=m.extra_scale_factor,
        layer_dims=layer_dims,
        matrices=matrices,
    )


def loss_scaling(cfg: Config) -> DynamicLossScale | None:
    """Megatron's dynamic loss scaling for float16 params (`precision.*loss_scale*`), else None."""
    return loss_scale(cfg.precision) if cfg.precision.param_dtype == DType.FLOAT16 else None


def param_groups(cfg: Config, model: Model, abstract_params) -> Any:
    """Megatron's param groups for the model: no weight decay for biases and 1-D params (unless
    `optimizer.weight_decay_1d`), then `optimizer.param_groups`; None if they change nothing."""
    o = cfg.optimizer
    has_decay = o.name in (OptimizerName.ADAMW, OptimizerName.MUON)
    resolved = groups.param_groups(
        abstract_params,
        weight_decay_1d=o.weight_decay_1d or not has_decay,
        rules=o.param_groups,
        ndims=model.layer_ndims(abstract_params),
    )
    return None if groups.is_trivial(resolved) else resolved
