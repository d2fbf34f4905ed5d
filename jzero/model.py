"""The model protocol: what `jzero train`, `jzero hlo` and `jzero memory` ask of a model, and how
the config names one.

`model.impl: "module:Class"` (default `jzero.train.model:GPTModel`, jzero's GPT) names the class;
`make_model` imports it and builds `Class(model_cfg, param_dtype=..., seed=train.seed, dp_axes=...)`.
`model_cfg` is, for a class that declares its own keys, an instance of them; else the `model:` section:

- Its own keys: a class attribute `config_class`, a frozen dataclass typed and with defaults as
  `jzero.config_schema`'s sections are. The `model:` section's keys but the harness's (`impl`,
  `vocab_size`, `seq_len`: `MODEL_HARNESS_KEYS`) are then its, parsed into it when the config loads (an
  unknown key, a wrong type, a bad enum value: one line; `--set model.KEY=...` as for any key), and it
  is what the class gets, and what its static `param_count` gets. A field named as a harness key
  (`vocab_size`) is that key: one value for both, by default the field's. The GPT's keys are refused
  for it. The config keeps it in `cfg.model.own`; `jzero.config.to_dict` writes its keys in `model:`
  (checkpoints, W&B, the processes' agreement), from which `from_dict` reads them back.
- No `config_class` (jzero's GPT): the `ModelConfig` of the section, the GPT's keys, of which the
  class reads those it needs (a model of one's own may ignore the GPT's: `n_heads`, `mlp`, ...).

The class raises `jzero.errors.ConfigError` for values it cannot take (one line, exit 2 from
the CLI; a `config_class` may raise it in `__post_init__`, naming the field). `dp_axes` are the mesh
axes each rank's loss runs manual over (`jzero.mesh.BATCH_AXES`): a model that needs statistics over
the whole data-parallel batch (a MoE's global load balance) sums them over these; a model that needs
none ignores it.

Params are any pytree of arrays (jzero's GPT: a nested dict); every `...(params)` method below
takes the params or their `ShapeDtypeStruct`s (`abstract_params()`) and returns a tree of the same
structure. The harness feeds token batches: `batch` is int32 `[B, seq_len + 1]` (`model.seq_len`;
inputs `batch[:, :-1]`, targets `batch[:, 1:]`), B the rows of one data-parallel rank in one
micro-batch on either ZeRO path (each rank's loss is its own call).

Beside the protocol's methods, the inspect tools ask a model for estimates that only it can give,
and the step for its flat units' names; each is optional, and the function of the same name here
gives its default when a model lacks it:

    token_exchange(tokens) -> TokenExchange | None   what expert parallelism moves (None: nothing)
    attention_elements(rows, tp) -> int | None       fewest elements of one attention-score buffer
                                                     (None: no buffer is counted as attention)
    remat -> bool                                    each unit recomputes its forward in backward
                                                     (False)
    param_count(model_cfg) -> int  (static)          the parameter count from the config alone, cheaply
                                                     (None: unknown; `jzero train`'s first pre-flight)
    activation_bytes(rows, tp) -> int                fewest bytes of activations one device holds for
                                                     its backward (0: none counted; `jzero train`'s
                                                     memory pre-flight, jzero.train.preflight)
    unit_key(path) -> str                            the flat path's name of a unit param's unit
                                                     (None: `build_zero`'s default rule)
    muon_matrices(params) -> PyTree                  per param the matrix (or matrices) Megatron's Muon
                                                     orthogonalises, a `muon.MatrixView`, or None
                                                     (default: every param 2-D per layer; `jzero.optim`)

A model may also keep non-trainable state beside its params (Megatron's buffers; jzero's GPT: each
MoE block's expert bias), replicated, no grad, no optimizer state, saved in checkpoints. It then has
three more methods (`model_state` below turns them into the step's `jzero.zero.common.state.ModelState`):

    init_state() -> PyTree | None                    the initial state (None: the model has none)
    loss_with_state(params, batch, model_state, tp_axis=None, ep_axis=None) -> (loss, metrics, stats)
                                                     the loss with the state; stats a pytree of
                                                     arrays the step sums over DP ranks and
                                                     micro-batches (jzero's GPT: tokens per expert)
    update_state(model_state, stats) -> (model_state, metrics)
                                                     once per step, after the grads' reduction and
                                                     before the optimizer step, on the summed stats
A model without `init_state` (or whose `init_state()` is None) trains as before, by `loss_and_metrics`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jzero.errors import ConfigError
from jzero.imports import import_object

if TYPE_CHECKING:
    import jax

    from jzero.config import Config

PyTree = Any
KEY = "model.impl"


@runtime_checkable
class Model(Protocol):
    """A language model the harness trains and the inspect tools compile (module docstring for `batch`)."""

    def init(self) -> PyTree:
        """The params, from the model's seed: global shapes, in `param_dtype` (jit with out_shardings
        shards them at birth)."""

    def abstract_params(self) -> PyTree:
        """`init()`'s `ShapeDtypeStruct`s (`jax.eval_shape(self.init)`): nothing is allocated."""

    def loss_and_metrics(
        self, params: PyTree, batch: jax.Array, tp_axis: str | None = None, ep_axis: str | None = None
    ) -> tuple[jax.Array, dict]:
        """(mean loss over the batch's tokens, {name: scalar} metrics, {} for none).

        On the spec path `params` are global arrays (XLA splits them) and `tp_axis` is None; on the
        flat path they are tp-local shards inside shard_map and `tp_axis` names the axis to sum
        row-parallel outputs over (given when some tp spec splits a param). On both paths, when some
        param `is_expert`, each rank holds its E/ep experts and `ep_axis` names the axis tokens
        travel over to them (all_to_all)."""

    def tp_specs(self, params: PyTree) -> PyTree:
        """Per param its model-parallel `PartitionSpec`: "tp" on the dims Megatron's tensor parallelism
        splits, "ep" on an expert param's expert dim, `P()` for a replicated param."""

    def units(self, params: PyTree) -> PyTree:
        """Per param its FSDP unit (`jzero.zero.build.build_zero`'s `units`): None outside any unit,
        else its leading stacked-layer dims (0 or 1); the loss must run each unit through
        `jzero.zero.common.units.unit`. All None: no units (ZeRO-3 gathers every param up front)."""

    def is_expert(self, params: PyTree) -> PyTree:
        """Per param whether it is an expert weight (data-parallel over the expert-DP domain)."""

    def layer_ndims(self, params: PyTree) -> PyTree:
        """Per param its dims per layer and expert (stacked [L] and [E] dims not counted): Megatron's
        param groups leave 1-D params (biases, norm scales) out of weight decay."""


REQUIRED = tuple(name for name in vars(Model) if not name.startswith("_"))  # the protocol's methods


@dataclasses.dataclass(frozen=True)
class TokenExchange:
    """What a model's expert parallelism sends over ep per micro-batch of one rank.

    Attributes:
      slot_bytes: the operand of one all-to-all, per rank (jzero's GPT: its `[E, C, D]` expert slots
        in param_dtype); one all-to-all moves (ep-1)/ep of it.
      per_microbatch: all-to-alls per micro-batch (jzero's GPT: 4 per MoE block, 2 forward and
        their transposes backward, 6 with remat).
      dropless: the exchange is ragged (jzero's GPT without capacity: its routed copies `[k N, D]`);
        `slot_bytes` is then their bytes, what uniform routing moves.
    """

    slot_bytes: int
    per_microbatch: int
    dropless: bool = False  # a ragged all-to-all of the routed copies: what it moves depends on the routing


def token_exchange(model: Model, tokens: int) -> TokenExchange | None:
    """`model.token_exchange(tokens)` for `tokens` routed by one rank per micro-batch; None (no
    exchange) for a model without the method."""
    method = getattr(model, "token_exchange", None)
    return None if method is None else method(tokens)


def attention_elements(model: Model, rows: int, tp: int) -> int | None:
    """`model.attention_elements(rows, tp)`: the fewest elements of one attention-score buffer of `rows`
    sequences on one tp rank (jzero's GPT: rows x heads/tp x T x T); None for a model without it."""
    method = getattr(model, "attention_elements", None)
    return None if method is None else method(rows, tp)


def activation_bytes(model: Model, rows: int, tp: int) -> int:
    """`model.activation_bytes(rows, tp)`: a lower bound on the activation bytes one tp rank keeps for the
    backward of `rows` sequences (one micro-batch); 0 for a model without it."""
    method = getattr(model, "activation_bytes", None)
    return 0 if method is None else int(method(rows, tp))


def param_count(cfg: Config) -> int | None:
    """The parameter count of the model `cfg.model.impl` names, from its class's static
    `param_count(model_cfg)` (module docstring) without building the model; None for a class without it."""
    method = getattr(model_class(cfg.model.impl), "param_count", None)
    return None if method is None else int(method(_model_cfg(cfg)))


def remat(model: Model) -> bool:
    """`model.remat`: whether each unit's forward runs again for its backward (ZeRO-3 then gathers
    the unit's params again); False for a model without it."""
    return bool(getattr(model, "remat", False))


def unit_key(model: Model):
    """`model.unit_key`, the flat path's name of a unit param's unit from its key path (`build_zero`'s
    `unit_key`), for a model whose blocks are not a list or stack of their own; None (the default
    rule) for a model without it."""
    return getattr(model, "unit_key", None)


def model_state(model: Model):
    """The model's `ModelState` (init, update) when it keeps state (module docstring), else None."""
    import jax

    from jzero.zero.common.state import ModelState

    init = getattr(model, "init_state", None)
    if init is None or jax.eval_shape(init) is None:
        return None

    return ModelState(init, model.update_state)


def training_loss(model: Model):
    """The loss the step differentiates: `loss_with_state` for a model with state, else `loss_and_metrics`."""
    return model.loss_and_metrics if model_state(model) is None else model.loss_with_state


def model_class(path: str) -> type:
    """The class `path` ("package.module:Class") names; ConfigError naming `model.impl` when it
    cannot be imported, is not there, or lacks a method of the protocol."""
    cls = import_object(KEY, path)
    name = path.partition(":")[2]
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{KEY}={path!r}: {name} has no {', '.join(missing)} (the model protocol, jzero/model.py)")
    return cls


def make_model(cfg: Config) -> Model:
    """The model `cfg.model.impl` names, built as `Class(model_cfg, param_dtype=..., seed=cfg.train.seed,
    dp_axes=jzero.mesh.BATCH_AXES)`: `model_cfg` its own config (`cfg.model.own`) if it declares one, else
    `cfg.model`."""
    import jax.numpy as jnp

    from jzero.mesh import BATCH_AXES

    cls = model_class(cfg.model.impl)
    _check_constructor(cls)
    dtype = jnp.dtype(cfg.precision.param_dtype.value)
    return cls(_model_cfg(cfg), param_dtype=dtype, seed=cfg.train.seed, dp_axes=BATCH_AXES)


def _model_cfg(cfg: Config) -> Any:
    """What the model class is built with: its own keys (`config_class`), or the `model:` section."""
    return cfg.model if cfg.model.own is None else cfg.model.own


CONSTRUCTOR_KEYWORDS = ("param_dtype", "seed", "dp_axes")


def _check_constructor(cls: type) -> None:
    """ConfigError naming `model.impl` when `cls(cfg.model, param_dtype=, seed=, dp_axes=)` cannot bind."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself says
        return
    params = signature.parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in CONSTRUCTOR_KEYWORDS if k not in names]
    if missing:
        raise ConfigError(
            f"{KEY}: {cls.__name__}.__init__ takes no {', '.join(missing)}; jzero builds the model as "
            f"{cls.__name__}(cfg.model, param_dtype=, seed=, dp_axes=) (docs/cli.md, 'A model of your own')"
        )
