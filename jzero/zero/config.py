"""The library's configuration: which ZeRO stage, how its collectives are made, loss scaling, param-group rules.

Each type checks itself once, when it is constructed, and raises one `ConfigError` naming the
field (spelled as the CLI's `zero.*` / `precision.*` keys); nothing downstream checks again.
The CLI's config (`jzero.config`) composes these types. This module imports no JAX, so a
config can be read before JAX starts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re

import numpy as np

from jzero.errors import ConfigError


class ShardingStrategy(str, enum.Enum):
    """Megatron's `data_parallel_sharding_strategy`: what is sharded over the DP domain."""

    NO_SHARD = "no_shard"  # DDP: everything replicated, grads all-reduced
    OPTIM = "optim"  # ZeRO-1: optimizer state + fp32 main params sharded
    OPTIM_GRADS = "optim_grads"  # ZeRO-2: ... and the reduced gradients
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # ZeRO-3 / FSDP: ... and the model params


class OuterStrategy(str, enum.Enum):
    """Megatron-FSDP's `outer_dp_sharding_strategy`: what HSDP shards across the `dp_outer` replicas."""

    NO_SHARD = "no_shard"  # each replica holds the whole (inner-sharded) state; grads all-reduced across
    OPTIM = "optim"  # the optimizer state and fp32 main params are also sharded across the replicas


class ZeroPath(str, enum.Enum):
    """How the data-parallel collectives are produced."""

    SPEC = "spec"  # sharding specs; XLA emits the collectives
    FLAT = "flat"  # Megatron's flat buckets, explicit psum_scatter / all_gather
    OWNED = "owned"  # whole-tensor ownership: each param (or layer) stepped whole by one rank (Muon, Adafactor)


class OwnedBalance(str, enum.Enum):
    """How the owned path deals whole params (or layers) to the owners of their DP domain (`owned/plan.py`)."""

    ELEMENTS = "elements"  # largest first, each to the owner keeping its share of elements and state smallest
    MEGATRON = "megatron"  # Megatron-Core 0.16.1's ping-pong by size (its LayerWiseDistributedOptimizer)


class ParamGatherDType(str, enum.Enum):
    """The flat path's param all-gather in one byte per element (ZeRO++ qwZ, Megatron's fp8_param_gather):
    each rank quantizes its updated shard blockwise, scales absmax/127 or absmax/448 (`flat/quantize.py`)."""

    INT8 = "int8"
    FLOAT8_E4M3FN = "float8_e4m3fn"


def _enum(key: str, cls: type[enum.Enum], value) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ConfigError(f"{key}={value!r} is not one of: {choices}") from None


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Which ZeRO stage, and how its collectives are produced (the CLI's `zero:` section).

    Enum fields also take their string values (`ZeroConfig("optim", "flat")`).
    """

    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS
    path: ZeroPath = ZeroPath.SPEC
    bucket_size: int | None = None  # elements per flat bucket; None: one bucket per buffer (per unit)
    pad_for_high_nccl_busbw: bool = False  # pad buckets to lcm(dp, 128, 2**16)
    reshard_after_forward: bool = True  # ZeRO-3: gather each unit's params again for its backward (FSDP2's)
    outer_strategy: OuterStrategy = OuterStrategy.NO_SHARD  # HSDP (mesh.dp_outer > 1)
    # Flat path: all-gather the updated params in this dtype, a scale per 2048-element block of each
    # rank's shard; the fp32 main params stay exact (kept even for fp32 params). None = param_dtype.
    param_gather_dtype: ParamGatherDType | None = None
    # Share of the fp32 main params and optimizer state kept in host memory (pinned_host) between
    # steps, whole params (spec) or buckets (flat) in order (`common/offload.py`); 0 = none.
    offload_fraction: float = 0.0
    # Megatron's overlap_grad_reduce: every stage reduces each FSDP unit's grads inside the backward (DDP and
    # ZeRO-1: of the last micro-batch), not after it; ZeRO-3, and the spec path's ZeRO-2, always do
    # (`Stage.per_unit`). False: one reduction after the backward.
    overlap_grad_reduce: bool = True
    # Megatron's overlap_param_gather (ZeRO-1/2): the step leaves the updated params sharded and the next
    # step's forward gathers each unit's just before it runs. None: as overlap_grad_reduce (Megatron
    # needs it on), but off with param_gather_dtype (whose quantized gather follows the step); ignored
    # by no_shard (no gather) and optim_grads_params (which always does this).
    overlap_param_gather: bool | None = None
    # Owned path: how whole params (or layers) are dealt to their owners (`OwnedBalance`): "elements" (the
    # elements and optimizer state evened, largest first) or "megatron" (Megatron-Core 0.16.1's ping-pong).
    owned_balance: OwnedBalance = OwnedBalance.ELEMENTS

    def __post_init__(self):
        for key, cls in (
            ("strategy", ShardingStrategy),
            ("path", ZeroPath),
            ("outer_strategy", OuterStrategy),
            ("owned_balance", OwnedBalance),
        ):
            object.__setattr__(self, key, _enum(f"zero.{key}", cls, getattr(self, key)))
        if self.param_gather_dtype is not None:
            dtype = _enum("zero.param_gather_dtype", ParamGatherDType, self.param_gather_dtype)
            object.__setattr__(self, "param_gather_dtype", dtype)
        if self.bucket_size is not None and not self.bucket_size > 0:
            raise ConfigError(f"zero.bucket_size={self.bucket_size} must be positive")
        if not 0.0 <= self.offload_fraction <= 1.0:  # NaN too
            raise ConfigError(f"zero.offload_fraction={self.offload_fraction} must be in [0, 1]")
        if self.param_gather_dtype is not None:
            name = self.param_gather_dtype.value
            if self.path != ZeroPath.FLAT:
                raise ConfigError(
                    f"zero.param_gather_dtype={name} needs zero.path=flat (the spec path's gathers are XLA's)"
                )
            if self.strategy == ShardingStrategy.NO_SHARD:
                raise ConfigError(f"zero.param_gather_dtype={name}: zero.strategy=no_shard gathers no params")
        if self.path == ZeroPath.OWNED:
            _check_owned(self)
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ConfigError(
                "zero.overlap_param_gather=true needs zero.overlap_grad_reduce=true (as Megatron's); "
                "set zero.overlap_param_gather=false, or leave it null to follow overlap_grad_reduce"
            )
        zero3 = self.strategy == ShardingStrategy.OPTIM_GRADS_PARAMS
        if self.param_gather_dtype is not None and (zero3 or self.overlap_param_gather):
            why = "zero.strategy=optim_grads_params" if zero3 else "zero.overlap_param_gather=true"
            raise ConfigError(
                f"zero.param_gather_dtype={self.param_gather_dtype.value} quantizes the gather after the optimizer "
                f"step; with {why} the params are gathered in the forward instead (in the param dtype)"
            )

    @property
    def stage(self) -> Stage:
        """What this config shards and how its step is scheduled (`Stage`)."""
        overlap = self.overlap_param_gather
        if self.path == ZeroPath.OWNED:  # the params stay whole; one reduction to the owners per step or micro-batch
            return Stage.of(self.strategy, overlap_param_gather=False, overlap_grad_reduce=False, path=self.path)
        if overlap is None:  # Megatron needs overlap_grad_reduce for it; the quantized gather follows the step
            overlap = self.overlap_grad_reduce and self.param_gather_dtype is None
        return Stage.of(
            self.strategy, overlap_param_gather=overlap, overlap_grad_reduce=self.overlap_grad_reduce, path=self.path
        )


def _check_owned(config: ZeroConfig) -> None:
    """The owned path's limits: ZeRO-1/2 (the params stay whole on every rank), HSDP only with each
    replica holding the whole owned state, no host offload."""
    if config.strategy not in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS):
        raise ConfigError(
            f"zero.path=owned needs zero.strategy=optim or optim_grads (whole params are owned by one rank "
            f"each and gathered after the step), not {config.strategy.value}"
        )
    if config.outer_strategy != OuterStrategy.NO_SHARD:
        raise ConfigError("zero.path=owned needs zero.outer_strategy=no_shard (each HSDP replica owns the whole model)")
    if config.offload_fraction:
        raise ConfigError("zero.path=owned keeps the optimizer state in device memory: set zero.offload_fraction=0")
    if config.overlap_param_gather:
        raise ConfigError("zero.path=owned gathers the params after the step: set zero.overlap_param_gather=false")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A ZeRO stage resolved once (`ZeroConfig.stage`): what it shards over the DP domain and how its
    step is scheduled. Every rule that depends on the strategy and the overlap settings reads it here.

    strategy: Megatron's `data_parallel_sharding_strategy`.
    shards_state: the fp32 main params and optimizer state are split over DP (every strategy but no_shard).
    shards_grads: the reduced grads are split over DP, and every micro-batch reduce-scatters (ZeRO-2/3).
    shards_params: the model params are split over the inner DP axes (ZeRO-3).
    params_rest_sharded: the model params rest between steps split over the inner DP axes and the
      forward gathers each unit's: ZeRO-3, and ZeRO-1/2 with `overlap_param_gather`.
    per_unit: each FSDP unit's grads are reduced inside the backward, as soon as the unit's backward is
      done: Megatron's `overlap_grad_reduce`; ZeRO-3 always, and the spec path's ZeRO-2 always (its
      reduce-scatters are the hooks'). Else no param is in a unit: the flat path lays one set of buffers
      over the whole model (Megatron's without overlap), reduced after each backward, and the spec path's
      DDP and ZeRO-1 accumulate local grads over the micro-batches and reduce them once, after the last.
    """

    strategy: ShardingStrategy
    shards_state: bool
    shards_grads: bool
    shards_params: bool
    params_rest_sharded: bool
    per_unit: bool

    @classmethod
    def of(
        cls, strategy, *, overlap_param_gather: bool = False, overlap_grad_reduce: bool = True,
        path: ZeroPath = ZeroPath.SPEC,
    ) -> Stage:  # fmt: skip
        """The stage of `strategy` (the class docstring); `overlap_param_gather` applies to ZeRO-1/2."""
        strategy = ShardingStrategy(strategy)
        state = strategy != ShardingStrategy.NO_SHARD
        zero3 = strategy == ShardingStrategy.OPTIM_GRADS_PARAMS
        grads = zero3 or strategy == ShardingStrategy.OPTIM_GRADS
        rest_sharded = zero3 or (state and overlap_param_gather)
        per_unit = overlap_grad_reduce or rest_sharded or zero3 or (grads and ZeroPath(path) == ZeroPath.SPEC)
        return cls(strategy, state, grads, zero3, rest_sharded, per_unit)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """How fp16's loss scale moves (Megatron's `DynamicGradScaler` arguments; `common/loss_scale.py`).

    The first four are the CLI's `precision.*` keys of the same names.
    """

    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # finite steps before the scale grows (growth_interval)
    hysteresis: int = 2  # inf/nan steps before the first backoff
    backoff_factor: float = 0.5
    growth_factor: float = 2.0

    def __post_init__(self):
        for key in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
            value = getattr(self, key)
            if not value > 0 or not math.isfinite(value):  # NaN too
                raise ConfigError(f"{key}={value} must be positive")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(
                f"min_loss_scale={self.min_loss_scale} must be <= initial_loss_scale={self.initial_loss_scale}"
            )
        if not 0 < self.backoff_factor < 1 < self.growth_factor:
            raise ConfigError(
                f"need 0 < backoff_factor < 1 < growth_factor, got {self.backoff_factor} and {self.growth_factor}"
            )


@dataclasses.dataclass(frozen=True)
class SpikeGuard:
    """Skip a step whose grad norm spikes (MaxText's `skip_step_on_spikes`, OLMo-core's skip-step
    optimizer, in the form of the issue's "a multiple of its recent mean"; `common/spike.py`).

    Once the last `window` finite grad norms are in, a step whose norm exceeds `factor` x their mean
    keeps the old params and optimizer state (its optimizer step count too, so the learning rate does
    not advance), as an inf/nan step does. Every finite norm enters the window, a skipped one too, so a
    lasting change of scale becomes the new baseline after `window` steps rather than stalling the
    run. The CLI's `train.grad_norm_spike_factor` and `train.grad_norm_spike_window`.
    """

    factor: float  # skip when grad norm > factor x the mean of the last `window` norms
    window: int = 100

    def __post_init__(self):
        if not (math.isfinite(self.factor) and self.factor > 1):
            raise ConfigError(f"grad_norm_spike_factor={self.factor} must be a finite number > 1 (null = off)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"grad_norm_spike_window={self.window} must be an integer >= 1")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a ZeRO step runs, beside its `ZeroConfig`: `build_zero`'s keyword arguments, which `Zero`
    carries (`Zero.options`) so nothing downstream reads a config again.

    microbatches: gradient accumulation steps per step. grad_reduce_dtype: the dtype of the grad
    buffer and its DP reduction. clip_grad: Megatron's global-norm clipping across shards, None =
    off. loss_scale: fp16's dynamic loss scaling, None = off. has_aux: the loss returns (loss, metrics).
    skip_nonfinite: a step whose grad norm is inf or nan keeps the old params and optimizer state.
    spike_guard: a step whose grad norm spikes above its recent mean keeps them too (`SpikeGuard`), None = off.
    """

    microbatches: int = 1
    grad_reduce_dtype: np.dtype = np.dtype(np.float32)
    clip_grad: float | None = None
    loss_scale: DynamicLossScale | None = None
    has_aux: bool = False
    skip_nonfinite: bool = False
    spike_guard: SpikeGuard | None = None

    def __post_init__(self):
        object.__setattr__(self, "grad_reduce_dtype", np.dtype(self.grad_reduce_dtype))
        if not self.microbatches >= 1:
            raise ConfigError(f"microbatches={self.microbatches} must be >= 1")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ConfigError(f"clip_grad={self.clip_grad} must be positive (None = no clipping)")


@dataclasses.dataclass(frozen=True)
class ParamGroupRule:
    """Multipliers for the params whose name matches `pattern` (Megatron's param groups).

    A param's lr is `optimizer.lr * lr_mult` and its weight decay `optimizer.weight_decay *
    wd_mult`; a rule sets only the multipliers it gives, and later rules win.
    """

    pattern: str  # regular expression searched in the param's name, e.g. "tok_emb" or "blocks/.*/bias"
    lr_mult: float | None = None  # None = keep
    wd_mult: float | None = None  # None = keep (adamw only)

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"pattern={self.pattern!r} is not a regular expression: {e}") from None
        for key in ("lr_mult", "wd_mult"):
            value = getattr(self, key)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{key}={value} must be a finite number")
            if value is not None and not value >= 0:
                raise ConfigError(f"{key}={value} must be >= 0")
