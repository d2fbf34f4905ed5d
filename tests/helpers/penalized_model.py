"""`helpers.toy_model` with its MLP as one FSDP unit (`jzero.zero.unit`) and, in its loss, an L2 penalty
over all params: a loss that reads a unit's params outside `unit`, which a ZeRO step with units refuses
(`model.impl: helpers.penalized_model:PenalizedToyModel`)."""

import jax
import jax.numpy as jnp
import optax

from helpers.toy_model import ToyModel
from jzero.zero import unit


class PenalizedToyModel(ToyModel):
    def units(self, params):
        return {name: 0 if name in ("fc1", "fc2") else None for name in params}

    def loss_and_metrics(self, params, batch, tp_axis=None, ep_axis=None):
        def mlp(p, x):
            h = jax.nn.gelu(x @ p["fc1"]) @ p["fc2"]
            return h if tp_axis is None else jax.lax.psum(h, tp_axis)

        x = params["emb"][batch[:, :-1]]
        h = unit(mlp, {"fc1": params["fc1"], "fc2": params["fc2"]}, x)
        logits = ((x + h + params["bias"]) @ params["head"]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss + 1e-4 * sum(jnp.sum(p.astype(jnp.float32) ** 2) for p in jax.tree.leaves(params)), {}
