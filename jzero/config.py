"""The CLI's typed run configuration: frozen dataclasses loaded from YAML plus `--set` overrides.

It composes the library's own types (`jzero.zero.config.ZeroConfig`, `jzero.mesh.MeshConfig`,
`jzero.zero.config.ParamGroupRule`), which check themselves when built, with the harness's
sections (model, train, data, ...). Every key is validated once, at load time; a bad key or
value raises one `ConfigError` that names it. This module imports no JAX so the CLI can read
the config (and `train.host_devices`) before JAX starts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jzero.errors import ConfigError
from jzero.mesh import AUTO_DP, MeshConfig
from jzero.zero.config import DynamicLossScale, ParamGroupRule, ZeroConfig

# `model.impl` of jzero's GPT, the default model (the keys of `ModelConfig` are its).
GPT_IMPL = "jzero.train.model:GPTModel"
# The largest EMA decay a bf16-stored moment follows closely: rounded to nearest every step it stops
# falling up to 2**-8 / (1 - beta) above its fp32 value, 8% at 0.95, 1.4x at 0.99 (`jzero.zero.common.moments`).
BF16_MAX_DECAY = 0.96


class DType(str, enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"  # needs dynamic loss scaling (precision.initial_loss_scale, ...)


class MomentsDType(str, enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class OptimizerName(str, enum.Enum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


class DataKind(str, enum.Enum):
    SYNTHETIC = "synthetic"  # seeded Markov-chain tokens
    TEXT = "text"  # byte-level tokens from a directory of text files
    INDEXED = "indexed"  # Megatron's indexed dataset, PREFIX.bin + PREFIX.idx (tools/preprocess_data.py)
    TOKENS = "tokens"  # a flat binary of token ids (nanoGPT's train.bin / val.bin)


class TokenDType(str, enum.Enum):
    """The token ids' type in a `data.kind: tokens` file (an indexed dataset's index says its own)."""

    UINT16 = "uint16"  # nanoGPT's (vocabularies up to 65536)
    UINT32 = "uint32"


class MlpKind(str, enum.Enum):
    GELU = "gelu"  # GPT-2: fc2(gelu(fc1(x)))
    SWIGLU = "swiglu"  # LLaMA: fc2(silu(x W_gate) * (x W_up)), fc1 holds [gate, up]


class NormKind(str, enum.Enum):
    LAYERNORM = "layernorm"  # scale and bias (bias only with model.bias)
    RMSNORM = "rmsnorm"  # scale only (LLaMA)


class PosKind(str, enum.Enum):
    LEARNED = "learned"  # a pos_emb[T, D] param (GPT-2)
    ROPE = "rope"  # rotary embeddings on q and k, no params (LLaMA)


class DropPolicy(str, enum.Enum):
    """`model.moe.drop_policy`: which token copies an expert over capacity keeps (Megatron's
    `moe_token_drop_policy`, and GShard's rule)."""

    PROBS = "probs"  # the highest routing probabilities (Megatron's default)
    POSITION = "position"  # the earliest tokens; the rest, at the end of the rank's batch, drop
    CHOICE_THEN_POSITION = "choice_then_position"  # GShard: first choices before second, then position


class AuxLossKind(str, enum.Enum):
    """`model.moe.aux_loss_kind`: over which tokens Switch's load-balancing loss takes its statistics
    (Megatron's `moe_router_load_balancing_type`)."""

    MICRO_BATCH = "micro_batch"  # each rank's micro-batch (Megatron's aux_loss)
    SEQUENCE = "sequence"  # each sequence, averaged (seq_aux_loss; DeepSeek-V2/V3)
    GLOBAL = "global"  # expert counts over every DP rank's micro-batch (global_aux_loss)


class ScoreFunction(str, enum.Enum):
    """`model.moe.score_function`: the router's scores from its logits (Megatron's `moe_router_score_function`)."""

    SOFTMAX = "softmax"  # probabilities over the experts; a token's top-k weighted by theirs (pre-softmax)
    SIGMOID = "sigmoid"  # DeepSeek-V3: one sigmoid per expert; the top-k weights renormalized to sum to 1


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (Switch/GShard, Megatron's `topk` router): some blocks' MLP becomes
    `num_experts` MLPs and a router.

    A softmax router sends each token to its `top_k` most probable experts, weighting each
    expert's output by that probability. Each rank routes its own tokens (per microbatch):
    an expert takes at most Megatron's `ceil((tokens * top_k / num_experts) * capacity_factor)`
    of them and drops the rest by `drop_policy` (`dropped_frac` in the metrics); without a
    capacity (null) nothing is dropped and the experts run only the routed tokens. The
    load-balancing loss is Switch's over `aux_loss_kind`'s tokens, the z-loss ST-MoE's.
    With `expert_bias` (DeepSeek-V3's aux-loss-free balancing, sigmoid scores) each MoE block
    keeps a per-expert bias, added to the scores only to choose the top-k, and moved once per
    step by `bias_update_rate` toward the experts that got fewer tokens than the mean.
    Expert weights are stacked on an expert dim split over `mesh.ep`; tokens reach them by
    all-to-all over ep.
    """

    num_experts: int = 0  # 0 = a dense model
    top_k: int = 2
    every: int = 1  # blocks every-1, 2*every-1, ... are MoE (Megatron's moe_layer_freq)
    capacity_factor: float | None = 1.25  # null = dropless: grouped matmuls over the routed tokens only
    drop_policy: DropPolicy = DropPolicy.PROBS  # over capacity: keep the most probable copies
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss, per MoE block
    aux_loss_kind: AuxLossKind = AuxLossKind.MICRO_BATCH
    z_loss_coef: float = 0.0  # ST-MoE router z-loss weight, per MoE block (Megatron: 1e-3 to start); 0 = off
    router_dtype: DType | None = DType.FLOAT32  # router logits, probabilities and output weighting; null = activations'
    score_function: ScoreFunction = ScoreFunction.SOFTMAX  # sigmoid: DeepSeek-V3's router
    expert_bias: bool = False  # aux-loss-free balancing (Megatron's moe_router_enable_expert_bias); needs sigmoid
    bias_update_rate: float = 1e-3  # the bias's step per optimizer step (moe_router_bias_update_rate, DeepSeek-V3's)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model: `impl` names its class (`jzero.model`, the protocol), which reads the keys below.

    `vocab_size` and `seq_len` are the harness's too (the data's ids, the batch's [B, seq_len + 1]
    tokens); the rest describe jzero's GPT (token embeddings, pre-norm attention and MLP blocks) and
    are checked only for it (`_check_gpt`): another model reads those it wants and checks them itself.
    The defaults are GPT-2 style; `configs/llama2_7b.yaml` shows the LLaMA options (swiglu, rmsnorm,
    no bias, rope, grouped-query attention).
    """

    impl: str = GPT_IMPL  # "package.module:Class" implementing `jzero.model.Model`
    vocab_size: int = 256  # byte-level text needs >= 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512  # 4 x d_model, as in GPT-2
    seq_len: int = 128
    tie_embeddings: bool = True  # output head reuses the token embedding
    mlp: MlpKind = MlpKind.GELU  # swiglu: fc1/kernel[D, 2, F_tp] (gate, up), fc2 row-parallel
    norm: NormKind = NormKind.LAYERNORM
    bias: bool = True  # biases of attn/proj, mlp/fc1, mlp/fc2 and layernorm (LLaMA: none)
    n_kv_heads: int | None = None  # grouped-query attention (LLaMA-2-70B: 8); None = n_heads
    pos: PosKind = PosKind.LEARNED
    scan_layers: bool = False  # blocks stacked [L, ...] (names blocks/mlp/fc1/kernel), lax.scan over them
    remat: bool = False  # jax.checkpoint on each block: recompute its activations in backward
    moe: MoEConfig = MoEConfig()  # off while moe.num_experts is 0




@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Megatron's mixed precision: the model copy in `param_dtype`, fp32 main params beside it
    when that is not fp32. float16 turns on Megatron's dynamic loss scaling (the keys below,
    `jzero.zero.common.loss_scale`): a step whose grads hold an inf or nan is skipped and the scale backs off.
    """

    param_dtype: DType = DType.FLOAT32  # the model copy used in forward/backward
    grad_reduce_dtype: DType = DType.FLOAT32  # dtype of the grad buffer and its reduction
    initial_loss_scale: float = 2.0**32  # float16 only, as the three below
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # finite steps before the scale doubles
    hysteresis: int = 2  # inf/nan steps before the scale first halves



@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: OptimizerName = OptimizerName.ADAMW
    lr: float = 3e-3  # peak learning rate
    b1: float = 0.9  # Adam beta1; SGD momentum (0 = plain SGD)
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # AdamW only; see weight_decay_1d
    weight_decay_1d: bool = False  # also decay biases and 1-D params (norm scales); Megatron does not
    param_groups: tuple[ParamGroupRule, ...] = ()  # per-name lr/wd multipliers, applied in order
    clip_grad: float | None = 1.0  # global-norm clipping over all shards; None = off
    warmup_steps: int = 10  # linear warmup, then cosine decay to 10% of lr
    moments_dtype: MomentsDType = MomentsDType.FLOAT32  # moments stored in it, math in fp32 (Megatron's exp_avg_dtype)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 32  # sequences per step, over all data-parallel ranks
    microbatches: int = 1  # gradient accumulation steps (scanned)
    seed: int = 0  # init and data order
    log_every: int = 10  # progress-bar refresh interval in steps
    host_devices: int = 8  # simulated CPU devices (ignored on GPU)
    # Validation (Megatron's --eval-interval 1000, --eval-iters 100, scaled to short runs): every
    # eval_every steps and at the last, the mean loss over eval_batches fixed global batches of the
    # validation data (`data.val_path` or `data.val_fraction`); 0 = never. Synthetic data has none.
    eval_every: int = 50
    eval_batches: int = 4
    # Before compiling: refuse a run whose state and activations (a floor) cannot fit the devices' memory
    # (jzero.train.preflight); false runs it anyway.
    check_memory: bool = True


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from (docs/data.md): sequences of `model.seq_len + 1` tokens at offsets
    drawn from (`train.seed`, step), so a resumed run sees the same batches."""

    kind: DataKind = DataKind.TEXT
    # text: a directory (None = the Python stdlib's .py files); indexed: the PREFIX of PREFIX.bin/.idx;
    # tokens: the file (nanoGPT's train.bin)
    path: str | None = None
    dtype: TokenDType = TokenDType.UINT16  # kind tokens: the ids' type
    val_path: str | None = None  # validation data of the same kind (nanoGPT's val.bin); None = held out of path
    # Without val_path: the last fraction of path's tokens (at the document boundary nearest to it for
    # indexed data) is validation data, never trained on; Megatron's default split 969,30,1 holds out 3%.
    val_fraction: float = 0.03


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """orbax checkpoints in model space (per parameter), restorable onto any mesh/strategy/path."""

    dir: str | None = None  # None = no checkpoints
    every: int = 50  # save every N steps (and at the last step)
    keep: int = 3  # keep the newest N checkpoints
    async_: bool = dataclasses.field(default=True, metadata={"key": "async"})  # save in the background


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (docs/cluster.md): how long a process waits for the others before it
    exits with one line naming what it waited for. Every process must be given the same."""

    timeout_s: int = 60  # to join the run (all processes connected) and to leave it (all finished)
    heartbeat_timeout_s: int = 30  # a process silent this long is lost: the others exit
    # Progress, not only liveness: once the steps have begun, no process completing a step (its save and
    # evaluation included) for this long stops every process, naming the slowest and its phase; 0 = off.
    # Set it above the longest step, save or evaluation (and the spread of the processes' compile times).
    # 30 minutes by default: Megatron's collective timeout (`--distributed-timeout-minutes`) is 10, and
    # this one also covers a first step's compile. One process has no monitor.
    step_timeout_s: int = 1800


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    zero: ZeroConfig = ZeroConfig()
    precision: PrecisionConfig = PrecisionConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    @property
    def dp_domain_size(self) -> int:
        """Ranks dense params are data-parallel over (dp_outer x dp x ep); needs a resolved mesh.dp."""
        self._check_resolved()
        return self.mesh.dp_outer * self.mesh.dp * self.mesh.ep

    @property
    def n_devices(self) -> int:
        """Devices of the mesh; needs a resolved mesh.dp."""
        self._check_resolved()
        return self.mesh.dp_outer * self.mesh.dp * self.mesh.ep * self.mesh.tp

    def _check_resolved(self) -> None:
        if self.mesh.dp == AUTO_DP:
            raise ConfigError("mesh.dp=-1 is not resolved yet: resolve_mesh(cfg, device count) fills it in")


# ---------------------------------------------------------------- parsing


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Checks and converts one YAML value to the field type `tp`."""
    origin = typing.get_origin(tp)
    if origin is tuple:  # tuple[Item, ...]: a YAML list
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return tuple(_build(item, v, f"{key}[{i}].") for i, v in enumerate(value))
        return tuple(_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, inner, value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(m.value for m in tp)
            raise ConfigError(f"{key}={value!r} is not one of: {choices}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}={value!r} must be of type {tp.__name__}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {_yaml_key(f): f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]} (known: {', '.join(sorted(fields))})")
    missing = [
        key
        for key, f in ((_yaml_key(f), f) for f in dataclasses.fields(cls))
        if key not in raw and f.default is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"config key {prefix}{missing[0]} is required")
    kwargs = {}
    for key_name, value in raw.items():
        name, key = fields[key_name], f"{prefix}{key_name}"
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{key}.")
        else:
            kwargs[name] = _coerce(key, tp, value)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a library type checked itself: name the key as this file spells it
        raise ConfigError(_prefixed(prefix, str(e))) from None


def _prefixed(prefix: str, message: str) -> str:
    """`message` (which names a field first) with the field's section `prefix`, unless it has it."""
    return message if not prefix or message.startswith(prefix) else prefix + message


def _yaml_key(f: dataclasses.Field) -> str:
    """The YAML spelling of a field (`async` is a Python keyword, so its field is `async_`)."""
    return f.metadata.get("key", f.name)


def _apply_override(raw: dict, assignment: str) -> None:
    """Applies one `a.b=value` override (value parsed as YAML) to the raw dict."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r} must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or type(e).__name__  # str(e) spans several lines
        raise ConfigError(f"--set {assignment!r}: the value {text!r} is not valid YAML ({problem})") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Loads YAML, applies `--set` overrides, validates.

    With no path the embedded default is used: the dataclass defaults above, which
    `configs/default.yaml` spells out (a test keeps the two equal).
    """
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:  # str(e) spans several lines
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or e
            raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
        if not isinstance(raw, dict):  # before --set, which would index into it
            raise ConfigError(
                f"config file {path} must be a mapping of sections (model:, train:, ...), "
                f"not a {type(raw).__name__}: {str(raw)[:80]}"
            )
    for assignment in overrides:
        _apply_override(raw, assignment)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def resolve_mesh(cfg: Config, n_devices: int) -> Config:
    """`cfg` with `mesh.dp=-1` filled in for `n_devices` devices, then validated again (the batch
    split depends on dp). With mesh.dp set, `cfg` itself: `make_mesh` checks it against the devices.

    Called once the device count is known (`jzero.run.build_run`, after JAX has started).
    """
    mesh = cfg.mesh.resolve(n_devices)
    if mesh == cfg.mesh:
        return cfg
    cfg = dataclasses.replace(cfg, mesh=mesh)
    validate(cfg)
    return cfg


def from_dict(raw: dict) -> Config:
    """Builds and validates a Config from a nested dict (e.g. a checkpoint's metadata)."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    """The config as plain YAML/JSON-able values."""

    def plain(v):
        if isinstance(v, enum.Enum):
            return v.value
        if dataclasses.is_dataclass(v):
            return {_yaml_key(g): plain(getattr(v, g.name)) for g in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [dataclasses.asdict(x) if dataclasses.is_dataclass(x) else plain(x) for x in v]
        return v

    return {
        f.name: {
            _yaml_key(g): plain(getattr(getattr(cfg, f.name), g.name)) for g in dataclasses.fields(getattr(cfg, f.name))
        }
        for f in dataclasses.fields(cfg)
    }


# ---------------------------------------------------------------- validation


def _positive(key: str, value: int | float) -> None:
    if not value > 0:  # NaN too
        raise ConfigError(f"{key}={value} must be positive")


def _check_finite(prefix: str, section: Any) -> None:
    """Every float of the dataclass `section` (and of the dataclasses in its tuples) is finite."""
    for f in dataclasses.fields(section):
        key, value = f"{prefix}.{_yaml_key(f)}", getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        if dataclasses.is_dataclass(value):
            _check_finite(key, value)
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_finite(f"{key}[{i}]", item)


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
    if o.clip_grad is not None:
        _positive("optimizer.clip_grad", o.clip_grad)
    if o.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    _check_param_groups(o)
    if o.moments_dtype == MomentsDType.BFLOAT16:
        key, beta = max((("b1", o.b1), ("b2", o.b2 if o.name != OptimizerName.SGD else 0.0)), key=lambda kv: kv[1])
        if beta > BF16_MAX_DECAY:
            raise ConfigError(
                f"optimizer.moments_dtype=bfloat16 with optimizer.{key}={beta}: a moment stored in bf16 stops "
                f"decaying up to 2**-8 / (1 - {key}) above its value; use {key} <= {BF16_MAX_DECAY} "
                "or moments_dtype=float32"
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
        raise ConfigError(_prefixed("precision.", str(e))) from None


def _check_param_groups(o: OptimizerConfig) -> None:
    for i, rule in enumerate(o.param_groups):  # each rule checked its own values (`ParamGroupRule`)
        if rule.wd_mult is not None and o.name != OptimizerName.ADAMW:
            key = f"optimizer.param_groups[{i}]"
            raise ConfigError(f"{key}.wd_mult: optimizer.name={o.name.value} has no weight decay (adamw has)")


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


def validate(cfg: Config) -> None:
    """Checks values and cross-key constraints (can the mesh split this model and batch?)."""
    m, mesh, t, o = cfg.model, cfg.mesh, cfg.train, cfg.optimizer
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if isinstance(value, int) and not isinstance(value, bool):
            _positive(f"model.{f.name}", value)
    for key in ("steps", "global_batch", "microbatches", "log_every", "host_devices"):
        _positive(f"train.{key}", getattr(t, key))
    for f in dataclasses.fields(cfg):
        _check_finite(f.name, getattr(cfg, f.name))
    _check_optimizer(o)
    _check_precision(cfg.precision)
    _positive("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    for key in ("timeout_s", "heartbeat_timeout_s"):
        _positive(f"distributed.{key}", getattr(cfg.distributed, key))
    if cfg.distributed.step_timeout_s < 0:
        raise ConfigError(f"distributed.step_timeout_s={cfg.distributed.step_timeout_s} must be >= 0 (0 = off)")
    if m.impl == GPT_IMPL:
        _check_gpt(m, mesh)
    # With mesh.dp=-1 the split is checked by resolve_mesh, once the device count is known.
    if mesh.dp != AUTO_DP and t.global_batch % (cfg.dp_domain_size * t.microbatches):
        raise ConfigError(
            f"train.global_batch={t.global_batch} must be divisible by the data-parallel size "
            f"(mesh.dp_outer*mesh.dp*mesh.ep={cfg.dp_domain_size}) x train.microbatches={t.microbatches}"
        )
    _check_data(cfg)
