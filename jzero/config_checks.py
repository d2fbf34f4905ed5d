"""The run configuration's checks: each value's range and the constraints across keys (can the mesh
split this model and batch?), one `ConfigError` naming the key.

`validate` runs once a `Config` is built (`jzero.config.load_config`, `from_dict`, `resolve_mesh`).
The library's types check their own fields when built (`ZeroConfig`, `MeshConfig`,
`ParamGroupRule`, and `DynamicLossScale`, which `loss_scale` builds from the `precision.*` keys);
`keyed` spells the field their error names as the CLI's key. Their checks are not repeated here,
but for one message for every key that is not a finite number, given first. This module starts
no JAX: it imports an optax optimizer named in the config (`optax_function`), whose signature it checks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from jzero.config_schema import (
    GPT_IMPL,
    AttentionImpl,
    Config,
    DataKind,
    DType,
    ModelConfig,
    MomentsDType,
    OptaxConfig,
    OptimizerConfig,
    OptimizerName,
    PosKind,
    PrecisionConfig,
    ScoreFunction,
    TrainConfig,
    yaml_key,
)
from jzero.errors import ConfigError
from jzero.imports import import_object
from jzero.mesh import AUTO_DP, MeshConfig
from jzero.zero.config import DynamicLossScale, SpikeGuard, ZeroConfig, ZeroPath

# The largest EMA decay a bf16-stored moment follows closely: rounded to nearest every step it stops
# falling up to 2**-8 / (1 - beta) above its fp32 value, 8% at 0.95, 1.4x at 0.99 (`jzero.zero.common.moments`).
BF16_MAX_DECAY = 0.96


def keyed(section: str, error: ConfigError) -> ConfigError:
    """A library type's `error`, whose message names its field first (`hysteresis=0 must be positive`),
    with that field spelled as the CLI's key in `section` (`precision.`), unless it already is."""
    message = str(error)
    return ConfigError(message if not section or message.startswith(section) else section + message)


def _positive(key: str, value: int | float) -> None:
    if not value > 0:  # NaN too
        raise ConfigError(f"{key}={value} must be positive")


# The counts a compiled step holds or compares in int32 (the step, the schedule's warmup and decay, the loss
# scale's and spike guard's counters, Newton-Schulz's loop): each must be below 2**31.
INT32_COUNTS = (
    "train.steps",
    "train.grad_norm_spike_window",
    "optimizer.warmup_steps",
    "optimizer.muon.ns_steps",
    "precision.loss_scale_window",
    "precision.hysteresis",
)
# Seconds a run waits: JAX's distributed runtime takes them in int32 (2**31 and above: a TypeError there, after
# the processes started), Python's waits up to `threading.TIMEOUT_MAX` (an OverflowError after the first save).
TIMEOUTS = (
    "distributed.timeout_s",
    "distributed.heartbeat_timeout_s",
    "distributed.step_timeout_s",
    "checkpoint.timeout_s",
)
# `train.seed` seeds numpy's generators (non-negative) and `jax.random.key` (a C long): [0, 2**63).
SEED_BOUND = 2**63
# `train.host_devices`: XLA's CPU client makes every simulated device when JAX starts, in time and memory
# linear in their number (4096: ~7 s and ~0.7 GB on one core; 100000 took minutes), before any check of the
# mesh. jzero's tests and docs use 8 per process (`jzero launch --local N` multiplies it by N), so 4096 is
# far above any CPU mesh worth simulating yet refuses a typo at once.
MAX_HOST_DEVICES = 4096


def _check_counts(cfg: Config) -> None:
    """`INT32_COUNTS` below 2**31 and `train.seed` in [0, 2**63): larger fail in JAX as an OverflowError;
    `TIMEOUTS` below 2**31 seconds."""
    for key in INT32_COUNTS:
        value = functools.reduce(getattr, key.split("."), cfg)
        if value >= 2**31:
            raise ConfigError(f"{key}={value} must be < 2**31 (a count the compiled step holds in int32)")
    for key in TIMEOUTS:
        if (value := functools.reduce(getattr, key.split("."), cfg)) >= 2**31:
            raise ConfigError(f"{key}={value} must be < 2**31 seconds")
    if not 0 <= cfg.train.seed < SEED_BOUND:
        raise ConfigError(f"train.seed={cfg.train.seed} must be in [0, 2**63)")


def _check_finite(prefix: str, section: Any) -> None:
    """Every float of the dataclass `section` (and of its dataclass fields) is finite; a field that is no key
    (`ModelConfig.own`) holds keys of `section` itself."""
    for f in dataclasses.fields(section):
        key, value = prefix if yaml_key(f) is None else f"{prefix}.{yaml_key(f)}", getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        if dataclasses.is_dataclass(value):
            _check_finite(key, value)


def _check_optimizer(o: OptimizerConfig) -> None:
    _positive("optimizer.lr", o.lr)
    for key in ("b1", "b2"):  # b1 is also SGD's momentum; at 1 Adam's bias correction 1 - b**t is 0
        value = getattr(o, key)
        if not 0 <= value < 1:
            raise ConfigError(f"optimizer.{key}={value} must be in [0, 1)")
    # optax checks nothing, but eps=0 makes Adam's update 0/0 = NaN wherever a gradient is exactly 0.
    _positive("optimizer.eps", o.eps)
    if not o.weight_decay >= 0:
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    if o.clip_grad is not None:  # `StepOptions` checks it again in build_zero, in its words for Python callers
        _positive("optimizer.clip_grad", o.clip_grad)
    if o.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    _check_param_groups(o)
    decays = _check_optax(o)
    if o.moments_dtype == MomentsDType.BFLOAT16:
        if o.name != OptimizerName.OPTAX:
            decays = [("b1", o.b1), ("b2", o.b2 if o.name != OptimizerName.SGD else 0.0)]
            decays += [("muon.momentum", o.muon.momentum)] if o.name == OptimizerName.MUON else []
        key, beta = max(decays, key=lambda kv: kv[1], default=("b1", 0.0))
        if beta > BF16_MAX_DECAY:
            raise ConfigError(
                f"optimizer.moments_dtype=bfloat16 with optimizer.{key}={beta}: a moment stored in bf16 stops "
                f"decaying up to 2**-8 / (1 - {key}) above its value; use {key} <= {BF16_MAX_DECAY} "
                "or moments_dtype=float32"
            )


OPTAX_KEY = "optimizer.optax.name"


def optax_function(name: str) -> tuple[Callable, bool]:
    """The function `optimizer.optax.name` names (a bare name is optax's: `lion`; `optax.contrib.muon`;
    `package.module:function`) and whether it takes a `learning_rate`; ConfigError naming the key when it
    cannot be imported or is not callable."""
    fn = import_object(OPTAX_KEY, name, "function", default_module="optax")
    if not callable(fn):
        raise ConfigError(f"{OPTAX_KEY}={name!r} is a {type(fn).__name__}, not a function returning an optax optimizer")
    try:
        takes_lr = "learning_rate" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: no learning_rate
        takes_lr = False
    return fn, takes_lr


def _check_optax(o: OptimizerConfig) -> list[tuple[str, float]]:
    """`optimizer.optax`, set for name optax only: a function whose signature takes its args, all but
    `learning_rate` (the run's schedule). Returns its EMA decays (`b1`, `b2`: given or its defaults) as
    (key, value) for the bf16 moments' check."""
    x = o.optax
    if o.name != OptimizerName.OPTAX:
        if x != OptaxConfig():
            raise ConfigError(f"optimizer.optax is set but optimizer.name={o.name.value}: set optimizer.name=optax")
        return []
    if x.name is None:
        raise ConfigError(
            f"optimizer.name=optax needs {OPTAX_KEY}: an optax optimizer (lion, adafactor, optax.contrib.muon) "
            "or package.module:function"
        )
    if "learning_rate" in x.args:
        raise ConfigError(
            "optimizer.optax.args.learning_rate: the learning rate is the run's schedule (optimizer.lr, warmup_steps)"
        )
    _check_finite_args("optimizer.optax.args", x.args)
    fn, _ = optax_function(x.name)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to check the args against: the call says
        return []
    named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        takes = ", ".join(p.name for p in named if p.name != "learning_rate")
        for arg in x.args:
            if arg not in {p.name for p in named}:
                raise ConfigError(f"optimizer.optax.args.{arg}: {x.name} takes no {arg} (it takes: {takes})")
    for p in named:
        if p.default is p.empty and p.name != "learning_rate" and p.name not in x.args:
            raise ConfigError(f"optimizer.optax.args.{p.name} is required: {x.name} has no default for it")
    decays = {p.name: p.default for p in named if p.name in ("b1", "b2")} | {
        k: v for k, v in x.args.items() if k in ("b1", "b2")
    }
    return [(f"optax.args.{k}", v) for k, v in decays.items() if isinstance(v, int | float)]


def _check_finite_args(key: str, value: Any) -> None:
    """Every float in `value` (optax arguments: mappings, sequences and numbers, as YAML gives them) is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_finite_args(f"{key}.{k}", v)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_finite_args(f"{key}[{i}]", v)


def _check_muon(cfg: Config) -> None:
    o, m = cfg.optimizer, cfg.optimizer.muon
    if o.name != OptimizerName.MUON:
        return
    if not 0 <= m.momentum < 1:
        raise ConfigError(f"optimizer.muon.momentum={m.momentum} must be in [0, 1)")
    _positive("optimizer.muon.ns_steps", m.ns_steps)
    _positive("optimizer.muon.extra_scale_factor", m.extra_scale_factor)
    if cfg.zero.path == ZeroPath.FLAT:
        raise ConfigError(
            "optimizer.name=muon cannot run on zero.path=flat, which steps slices of flat buffers: Newton-Schulz "
            "orthogonalises whole matrices: zero.path=owned steps each whole by one rank at DDP's wire bytes "
            "(docs/owned.md), zero.path=spec lets XLA partition it"
        )


def _check_precision(p: PrecisionConfig) -> None:
    if p.grad_reduce_dtype == DType.FLOAT16 and p.param_dtype != DType.FLOAT16:
        raise ConfigError(
            f"precision.grad_reduce_dtype=float16 needs precision.param_dtype=float16 (loss scaling), "
            f"got {p.param_dtype.value}"
        )
    loss_scale(p)  # the loss-scaling keys check themselves (`DynamicLossScale`)


def loss_scale(p: PrecisionConfig) -> DynamicLossScale:
    """`precision`'s dynamic loss scaling (the four `*loss_scale*` / `hysteresis` keys); errors name the keys."""
    try:
        return DynamicLossScale(p.initial_loss_scale, p.min_loss_scale, p.loss_scale_window, p.hysteresis)
    except ConfigError as e:
        raise keyed("precision.", e) from None


def _check_param_groups(o: OptimizerConfig) -> None:
    for i, rule in enumerate(o.param_groups):  # each rule checked its own values (`ParamGroupRule`)
        if rule.wd_mult is not None and o.name not in (OptimizerName.ADAMW, OptimizerName.MUON):
            key = f"optimizer.param_groups[{i}]"
            if o.name == OptimizerName.OPTAX:
                raise ConfigError(
                    f"{key}.wd_mult: optimizer.name=optax decays by its own args (optimizer.optax.args), "
                    "which read no wd_mult (adamw's and muon's weight decay do)"
                )
            raise ConfigError(f"{key}.wd_mult: optimizer.name={o.name.value} has no weight decay (adamw and muon have)")


def _check_moe(m: ModelConfig, mesh: MeshConfig) -> None:
    moe = m.moe
    if moe.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be >= 0 (0 = a dense model)")
    if moe.num_experts == 0:
        return
    _positive("model.moe.every", moe.every)
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be in [1, model.moe.num_experts={moe.num_experts}]")
    if moe.num_experts % mesh.ep:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be divisible by mesh.ep={mesh.ep}")
    if moe.every > m.n_layers:
        raise ConfigError(f"model.moe.every={moe.every} > model.n_layers={m.n_layers}: no block would be MoE")
    if m.scan_layers and moe.every != 1:
        raise ConfigError(
            f"model.scan_layers=true stacks identical blocks: it needs model.moe.every=1, got {moe.every}"
        )
    if moe.capacity_factor is not None:
        _positive("model.moe.capacity_factor", moe.capacity_factor)
    for key in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        if not getattr(moe, key) >= 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)} must be >= 0")
    if moe.expert_bias and moe.score_function != ScoreFunction.SIGMOID:
        raise ConfigError(  # Megatron's rule: the bias shifts scores on a fixed scale, not probabilities
            f"model.moe.expert_bias=true needs model.moe.score_function=sigmoid, got {moe.score_function.value}"
        )


def _check_gpt(m: ModelConfig, mesh: MeshConfig) -> None:
    """jzero's GPT: can the mesh split its heads, MLP and experts (the keys only it reads)?"""
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
    if m.n_heads % mesh.tp:
        raise ConfigError(f"model.n_heads={m.n_heads} must be divisible by mesh.tp={mesh.tp}")
    if m.d_ff % mesh.tp:
        raise ConfigError(f"model.d_ff={m.d_ff} must be divisible by mesh.tp={mesh.tp}")
    if m.n_kv_heads is not None:
        if m.n_heads % m.n_kv_heads:
            raise ConfigError(f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.n_kv_heads}")
        if m.n_kv_heads % mesh.tp:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must be divisible by mesh.tp={mesh.tp}")
    if m.pos == PosKind.ROPE and (m.d_model // m.n_heads) % 2:
        raise ConfigError(
            f"model.pos=rope needs an even head dim, got model.d_model/model.n_heads={m.d_model // m.n_heads}"
        )
    _check_moe(m, mesh)


def _check_data(cfg: Config) -> None:
    d, t = cfg.data, cfg.train
    if d.kind == DataKind.TEXT and cfg.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} must be >= 256 for data.kind=text (byte tokens)")
    if d.kind in (DataKind.INDEXED, DataKind.TOKENS) and d.path is None:
        what = "the PREFIX of PREFIX.bin/.idx" if d.kind == DataKind.INDEXED else "a file of token ids"
        raise ConfigError(f"data.kind={d.kind.value} needs data.path: {what}")
    if d.kind == DataKind.SYNTHETIC and d.val_path is not None:
        raise ConfigError("data.val_path: data.kind=synthetic has no validation data (every batch is new)")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every} must be >= 0 (0 = no validation)")
    _positive("train.eval_batches", t.eval_batches)


def spike_guard(t: TrainConfig) -> SpikeGuard | None:
    """`train.grad_norm_spike_*`'s guard, None when `grad_norm_spike_factor` is null; errors name the keys."""
    if t.grad_norm_spike_factor is None:
        return None
    try:
        return SpikeGuard(t.grad_norm_spike_factor, t.grad_norm_spike_window)
    except ConfigError as e:
        raise keyed("train.", e) from None


def _check_sinks(t: TrainConfig) -> None:
    """The metrics sinks' keys (`jzero.train.sinks`): no empty names, and no W&B detail without its project.
    Whether the packages are installed and the directories writable is checked where the run starts."""
    for key in ("tensorboard_dir", "wandb_project", "wandb_exp_name", "wandb_save_dir"):
        value = getattr(t, key)
        if value is not None and not value.strip():
            raise ConfigError(f"train.{key}={value!r} is empty: give a name, or null for none")
    for key in ("wandb_exp_name", "wandb_save_dir"):
        if getattr(t, key) is not None and t.wandb_project is None:
            raise ConfigError(f"train.{key} is set but train.wandb_project is null: set the project to log to W&B")


def _check_attention(cfg: Config) -> None:
    """`model.attention: cudnn` forced: cuDNN's fused kernel runs bf16/fp16 with head dims 8, 16, ..., 128."""
    m, dtype = cfg.model, cfg.precision.param_dtype.value
    head_dim = m.d_model // m.n_heads
    if m.attention != AttentionImpl.CUDNN:
        return
    if dtype not in ("bfloat16", "float16"):
        raise ConfigError(
            f"model.attention=cudnn needs precision.param_dtype bfloat16 or float16 (cuDNN's fused attention), "
            f"got {dtype}; model.attention=auto chooses for you"
        )
    if head_dim % 8 or head_dim > 128:
        raise ConfigError(
            f"model.attention=cudnn needs a head dim (model.d_model/model.n_heads) that is a multiple of 8 "
            f"and at most 128, got {head_dim}; model.attention=auto chooses for you"
        )


def validate(cfg: Config) -> None:
    """Checks values and cross-key constraints (can the mesh split this model and batch?)."""
    m, mesh, t, o = cfg.model, cfg.mesh, cfg.train, cfg.optimizer
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if isinstance(value, int) and not isinstance(value, bool):
            _positive(f"model.{f.name}", value)
    for key in ("steps", "global_batch", "microbatches", "log_every", "host_devices"):
        _positive(f"train.{key}", getattr(t, key))
    if t.host_devices > MAX_HOST_DEVICES:
        raise ConfigError(
            f"train.host_devices={t.host_devices} must be <= {MAX_HOST_DEVICES} (simulated CPU devices of one "
            "process; JAX makes each as it starts)"
        )
    _check_counts(cfg)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not isinstance(section, (ZeroConfig, MeshConfig)):  # the library's sections checked themselves
            _check_finite(f.name, section)
    _check_optimizer(o)
    _check_muon(cfg)
    _check_precision(cfg.precision)
    spike_guard(t)
    _positive("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    for key in ("timeout_s", "heartbeat_timeout_s"):
        _positive(f"distributed.{key}", getattr(cfg.distributed, key))
    for key, value in (("distributed.step_timeout_s", cfg.distributed.step_timeout_s),
                       ("checkpoint.timeout_s", cfg.checkpoint.timeout_s)):  # fmt: skip
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0 (0 = off)")
    if m.impl == GPT_IMPL:
        _check_gpt(m, mesh)
        _check_attention(cfg)
    # With mesh.dp=-1 the split is checked by resolve_mesh, once the device count is known.
    if mesh.dp != AUTO_DP and t.global_batch % (cfg.dp_domain_size * t.microbatches):
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by the data-parallel size "
            f"(mesh.dp_outer*mesh.dp*mesh.ep={cfg.dp_domain_size}) x train.microbatches={t.microbatches}"
        )
    _check_data(cfg)
    _check_sinks(t)
