"""A language model that is not jzero's GPT, for `model.impl: helpers.toy_model:ToyModel` (tests/ is on
the path): token embeddings, one residual MLP, an output head. It implements the protocol of
`jzero.model.Model` and nothing more (no units, no experts, none of the optional estimates), and
imports nothing from jzero: adding it to `jzero train`, `jzero hlo` and `jzero memory` is the key.

Params (V vocab_size, D d_model, F d_ff; the MLP split over tp as Megatron's):
  emb[V, D]   fc1[D, F_tp]   fc2[F_tp, D]   bias[D]   head[D, V]

`ToyModelWithOwnKeys` is the same model declaring its own `model:` keys (`config_class = ToyConfig`): the
GPT's keys are refused for it, and it is built from a `ToyConfig`.
"""

import dataclasses
import enum

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

SPECS = {"emb": P(), "fc1": P(None, "tp"), "fc2": P("tp", None), "bias": P(), "head": P()}


class ToyModel:
    def __init__(self, cfg, param_dtype=jnp.float32, seed: int = 0, dp_axes=()):  # no global statistics: dp_axes unused
        self.vocab, self.d, self.f = cfg.vocab_size, cfg.d_model, cfg.d_ff  # the GPT's other keys: ignored
        self.dtype, self.seed = jnp.dtype(param_dtype), seed
        self.act = jax.nn.gelu

    def init(self):
        k = jax.random.split(jax.random.key(self.seed), 4)
        normal = lambda key, shape, std: (std * jax.random.normal(key, shape)).astype(self.dtype)  # noqa: E731
        return {
            "emb": normal(k[0], (self.vocab, self.d), 0.02),
            "fc1": normal(k[1], (self.d, self.f), 0.02),
            "fc2": normal(k[2], (self.f, self.d), 0.02),
            "bias": jnp.zeros((self.d,), self.dtype),
            "head": normal(k[3], (self.d, self.vocab), 0.02),
        }

    def abstract_params(self):
        return jax.eval_shape(self.init)

    def loss_and_metrics(self, params, batch, tp_axis=None, ep_axis=None):
        """batch int32 [B, T + 1] -> (mean next-token cross-entropy, {"accuracy"})."""
        x = params["emb"][batch[:, :-1]]  # [B, T, D]
        h = self.act(x @ params["fc1"]) @ params["fc2"]  # row-parallel: a partial sum per tp rank
        if tp_axis is not None:
            h = jax.lax.psum(h, tp_axis)
        logits = ((x + h + params["bias"]) @ params["head"]).astype(jnp.float32)  # [B, T, V]
        targets = batch[:, 1:]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}

    def tp_specs(self, params):
        return {name: SPECS[name] for name in params}

    def units(self, params):
        return {name: None for name in params}

    def is_expert(self, params):
        return {name: False for name in params}

    def layer_ndims(self, params):
        return {name: x.ndim for name, x in params.items()}


class ToyModelWithoutDpAxes(ToyModel):
    """A class written from an older docs/cli.md: its constructor takes no dp_axes."""

    def __init__(self, cfg, param_dtype=jnp.float32, seed: int = 0):
        super().__init__(cfg, param_dtype, seed)


class Activation(str, enum.Enum):
    GELU = "gelu"
    RELU = "relu"


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """`ToyModelWithOwnKeys`'s `model:` keys beside the harness's `impl` and `seq_len`; `vocab_size` is the
    harness's key too, its default here the run's."""

    vocab_size: int = 256
    d_model: int = 32
    d_ff: int = 64
    activation: Activation = Activation.GELU


class ToyModelWithOwnKeys(ToyModel):
    config_class = ToyConfig

    def __init__(self, cfg: ToyConfig, param_dtype=jnp.float32, seed: int = 0, dp_axes=()):
        assert isinstance(cfg, ToyConfig), cfg
        super().__init__(cfg, param_dtype, seed)
        self.act = getattr(jax.nn, cfg.activation.value)


@dataclasses.dataclass
class MutableConfig:
    d_model: int = 32


class ToyModelWithAMutableConfig(ToyModel):
    """Declares keys in a dataclass that is not frozen: refused (a config is immutable and hashable)."""

    config_class = MutableConfig
