"""`helpers.toy_model` with one more param of zero elements, `prefix[0, D]` (soft-prompt tokens a config
turned off), which its loss prepends to the embedded tokens (`model.impl:
helpers.empty_param_model:EmptyParamToyModel`): a 0-size array in the params, the grads, the optimizer
state and the checkpoint."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from helpers.toy_model import ToyModel


class EmptyParamToyModel(ToyModel):
    def init(self):
        return {**super().init(), "prefix": jnp.zeros((0, self.d), self.dtype)}

    def loss_and_metrics(self, params, batch, tp_axis=None, ep_axis=None):
        rest = {k: v for k, v in params.items() if k != "prefix"}
        x = rest["emb"][batch[:, :-1]]
        prefix = jnp.broadcast_to(params["prefix"], (x.shape[0], *params["prefix"].shape))
        x = jnp.concatenate([prefix, x], axis=1)[:, params["prefix"].shape[0] :]
        h = jnp.maximum(x @ rest["fc1"], 0) @ rest["fc2"]
        if tp_axis is not None:
            h = jax.lax.psum(h, tp_axis)
        logits = ((x + h + rest["bias"]) @ rest["head"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), {}

    def tp_specs(self, params):
        return {**super().tp_specs({k: v for k, v in params.items() if k != "prefix"}), "prefix": P()}
