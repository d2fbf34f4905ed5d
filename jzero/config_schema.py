"""The run configuration's schema: its sections as frozen dataclasses, their enums and defaults.

One dataclass per YAML section (`model:`, `train:`, ...), one field per key, with the key's
meaning in a comment beside it; `Config` holds the sections. The library's own types
(`jzero.zero.config.ZeroConfig`, `jzero.mesh.MeshConfig`, `jzero.zero.config.ParamGroupRule`) are
sections or items here as they are, and `DynamicLossScale` gives the loss-scaling keys their
defaults. Loading is `jzero.config`'s, the checks across keys `jzero.config_checks`'s. This
module imports no JAX.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from jzero.errors import ConfigError
from jzero.mesh import AUTO_DP, MeshConfig
from jzero.zero.config import DynamicLossScale, ParamGroupRule, ZeroConfig

# `model.impl` of jzero's GPT, the default model (the keys of `ModelConfig` are its).
GPT_IMPL = "jzero.train.model:GPTModel"
# The `model:` keys the harness reads itself, whatever the model: the class, the data's ids, the batch's tokens.
MODEL_HARNESS_KEYS = ("impl", "vocab_size", "seq_len")


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
    MUON = "muon"  # Megatron's Muon for the matrices, AdamW for the rest (`optimizer.muon`)
    OPTAX = "optax"  # any optax optimizer, by name (`optimizer.optax`)


class NewtonSchulzDType(str, enum.Enum):
    """Megatron's `--muon-fp32-matmul-prec`: the dtype of Muon's Newton-Schulz GEMMs."""

    BFLOAT16 = "bfloat16"  # medium (its default)
    FLOAT32 = "float32"  # high


class MuonScaleMode(str, enum.Enum):
    """Megatron's `--muon-scale-mode`: the update's scale for a [out, in] matrix (`jzero.zero.common.muon`)."""

    SPECTRAL = "spectral"  # sqrt(max(out, in))
    SHAPE_SCALING = "shape_scaling"  # sqrt(max(1, out / in))
    UNIT_RMS_NORM = "unit_rms_norm"  # sqrt(out / in)


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
    GELU = "gelu"  # GPT-2: fc2(gelu(fc1(x))), gelu's tanh approximation (GPT-2's, nanoGPT's)
    GELU_EXACT = "gelu_exact"  # the same with the exact (erf) GELU: Megatron-LM's GPT, whatever --openai-gelu says
    SWIGLU = "swiglu"  # LLaMA: fc2(silu(x W_gate) * (x W_up)), fc1 holds [gate, up]


class AttentionImpl(str, enum.Enum):
    """Which kernel `jax.nn.dot_product_attention` runs (its `implementation`)."""

    AUTO = "auto"  # cudnn on a GPU for bf16/fp16 activations with a head dim cuDNN takes, else xla
    XLA = "xla"  # XLA's softmax(q k^T) v: the [B, H, T, T] scores in fp32, on any backend
    CUDNN = "cudnn"  # cuDNN's fused (flash) attention: GPU, bf16/fp16 only; the scores never stored

    def kernel(self, dtype: str, head_dim: int, backend: str) -> str:
        """The kernel this choice runs for `dtype` activations (a numpy name) with `head_dim` on JAX's
        `backend`: auto is cuDNN's on "gpu" for bfloat16/float16 with a head dim it takes (a multiple of 8,
        at most 128), else XLA's."""
        if self != AttentionImpl.AUTO:
            return self.value
        fused = backend == "gpu" and dtype in ("bfloat16", "float16") and head_dim % 8 == 0 and head_dim <= 128
        return "cudnn" if fused else "xla"


class RematKind(str, enum.Enum):
    """What each block's backward recomputes (Megatron's --recompute-granularity); YAML's true/false read as
    full/none."""

    NONE = "none"  # keep every activation the backward reads
    FULL = "full"  # recompute the block, keeping its input only (Megatron's full recompute)
    # keep the matmul outputs (dots without batch dims: the projections and MLP), recompute the rest: the
    # attention core, norms, activations (Megatron's selective recompute; jax's dots_with_no_batch_dims_saveable)
    SELECTIVE = "selective"

    @classmethod
    def _missing_(cls, value):
        return {True: cls.FULL, False: cls.NONE}.get(value) if isinstance(value, bool) else None


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
    are checked only for it (`jzero.config_checks`): another model reads those it wants and checks them itself,
    or declares keys of its own in their place (`own`).
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
    # attn/qkv/bias [R + 2, G_tp, K]: Megatron's --add-bias-linear QKV bias (GPT-2's c_attn bias). Off by default:
    # the key part cannot change the output (softmax is shift-invariant), its grad is rounding noise.
    qkv_bias: bool = False
    n_kv_heads: int | None = None  # grouped-query attention (LLaMA-2-70B: 8); None = n_heads
    pos: PosKind = PosKind.LEARNED
    scan_layers: bool = False  # blocks stacked [L, ...] (names blocks/mlp/fc1/kernel), lax.scan over them
    attention: AttentionImpl = AttentionImpl.AUTO  # the attention kernel; auto: cuDNN's fused one where it runs
    remat: RematKind = RematKind.NONE  # what each block's backward recomputes: none, full, selective
    # The loss's tokens per chunk: each chunk's [chunk, V] fp32 logits made, reduced and recomputed for backward,
    # never the whole [B, T, V] (a large vocabulary's peak); null: all at once.
    loss_chunk: int | None = None
    moe: MoEConfig = MoEConfig()  # off while moe.num_experts is 0
    # A model class's own keys: an instance of its `config_class` (jzero.model), parsed from this section's
    # keys but the harness's (MODEL_HARNESS_KEYS), which then takes no GPT key. None for a class that
    # declares none (jzero's GPT): it reads the keys above. Not a YAML key itself.
    own: Any = dataclasses.field(default=None, metadata={"key": None})


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Megatron's mixed precision: the model copy in `param_dtype`, fp32 main params beside it
    when that is not fp32. float16 turns on Megatron's dynamic loss scaling (the keys below,
    `jzero.zero.common.loss_scale`): a step whose grads hold an inf or nan is skipped and the scale backs off.
    """

    param_dtype: DType = DType.FLOAT32  # the model copy used in forward/backward
    grad_reduce_dtype: DType = DType.FLOAT32  # dtype of the grad buffer and its reduction
    # float16 only, the four below: `DynamicLossScale`'s fields and defaults (it checks them)
    initial_loss_scale: float = DynamicLossScale.initial_loss_scale
    min_loss_scale: float = DynamicLossScale.min_loss_scale
    loss_scale_window: int = DynamicLossScale.loss_scale_window  # finite steps before the scale doubles
    hysteresis: int = DynamicLossScale.hysteresis  # inf/nan steps before the scale first halves


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """`optimizer.name: muon`'s own keys, Megatron-LM's `--muon-*` flags and their defaults; the params
    it leaves to AdamW (embeddings, output head, biases, norm scales: what the model's `muon_matrices`
    names no matrix) use `optimizer.b1, b2, eps`, and both sides `optimizer.weight_decay`
    (docs/megatron.md, "Muon")."""

    momentum: float = 0.9  # --muon-momentum
    nesterov: bool = False  # --muon-use-nesterov
    ns_steps: int = 5  # --muon-num-ns-steps: Newton-Schulz iterations
    ns_dtype: NewtonSchulzDType = NewtonSchulzDType.BFLOAT16  # --muon-fp32-matmul-prec medium; float32: high
    scale_mode: MuonScaleMode = MuonScaleMode.SPECTRAL  # --muon-scale-mode, on [in, out] matrices
    extra_scale_factor: float = 1.0  # --muon-extra-scale-factor


class KeywordArgs(Mapping):
    """Keyword arguments from YAML passed through to a function (`optimizer.optax.args`): read-only and
    hashable as every config value is (a `Config` is a cache key), YAML's lists kept as tuples."""

    def __init__(self, items: Mapping[str, Any] = ()):
        self._items = {k: _frozen(v) for k, v in dict(items).items()}

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items(), key=lambda kv: kv[0])))

    def __repr__(self) -> str:
        return f"KeywordArgs({self._items!r})"


def _frozen(value: Any) -> Any:
    """A YAML value made immutable: mappings as KeywordArgs, lists as tuples."""
    if isinstance(value, Mapping):
        return KeywordArgs(value)
    return tuple(map(_frozen, value)) if isinstance(value, list | tuple) else value


@dataclasses.dataclass(frozen=True)
class OptaxConfig:
    """`optimizer.name: optax`'s own keys: an optax optimizer, or any function that returns an optax
    `GradientTransformation`, by name, its keyword arguments passed through (`jzero.optim.optax_by_name`).

    The run's schedule (`optimizer.lr`, `warmup_steps`) is its `learning_rate` (a transformation without
    that argument, `scale_by_lion`, is followed by `optax.scale_by_learning_rate`); `optimizer.clip_grad`
    clips before it and `param_groups`' `lr_mult` scales after it. Its weight decay is its own
    (`args: {weight_decay: ...}`, on every param): `optimizer.b1, b2, eps, weight_decay, weight_decay_1d`
    and `param_groups`' `wd_mult` are the built-in optimizers' and do not apply.
    """

    name: str | None = None  # lion (optax.lion), optax.contrib.schedule_free_adamw, package.module:function
    args: KeywordArgs = KeywordArgs()  # its keyword arguments but learning_rate, e.g. {b1: 0.9, weight_decay: 0.1}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: OptimizerName = OptimizerName.ADAMW
    lr: float = 3e-3  # peak learning rate
    b1: float = 0.9  # Adam beta1 (muon: its AdamW side's); SGD momentum (0 = plain SGD)
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # AdamW and Muon only; see weight_decay_1d
    weight_decay_1d: bool = False  # also decay biases and 1-D params (norm scales); Megatron does not
    param_groups: tuple[ParamGroupRule, ...] = ()  # per-name lr/wd multipliers, applied in order
    clip_grad: float | None = 1.0  # global-norm clipping over all shards; None = off
    warmup_steps: int = 10  # linear warmup, then cosine decay to 10% of lr
    moments_dtype: MomentsDType = MomentsDType.FLOAT32  # moments stored in it, math in fp32 (Megatron's exp_avg_dtype)
    muon: MuonConfig = MuonConfig()  # name muon only
    optax: OptaxConfig = OptaxConfig()  # name optax only


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
    # Megatron's --check-for-nan-in-loss-and-grad: a step whose grad norm is inf or nan keeps the old params
    # and optimizer state (checked in the step, before the update) and the run stops, naming the step and the
    # newest checkpoint. fp16's loss scaling skips such steps and goes on whatever this says.
    check_for_nan_in_loss_and_grad: bool = True
    # MaxText's skip_step_on_spikes, OLMo-core's skip-step optimizer: once grad_norm_spike_window finite grad norms
    # are in, a step whose grad norm exceeds grad_norm_spike_factor x their mean keeps the old params and optimizer
    # state and the run goes on (metrics spike_skipped; the history is saved with checkpoints). null = off.
    grad_norm_spike_factor: float | None = None
    grad_norm_spike_window: int = 100
    # Where else metrics.jsonl's scalars go, by its names, from process 0 (jzero.train.sinks; null = off).
    # Megatron's --tensorboard-dir: TensorBoard event files in this directory (pip install 'jzero[tensorboard]').
    tensorboard_dir: str | None = None
    # Megatron's --wandb-project, --wandb-exp-name, --wandb-save-dir: a Weights & Biases run in this project
    # (pip install 'jzero[wandb]'; WANDB_MODE=offline writes it locally), named wandb_exp_name (null: the
    # --out directory's name), its local files under wandb_save_dir (null: $WANDB_DIR, else --out).
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None


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
    # A save not finished this long after the run waits for it (the next save, the run's end: a stalled
    # filesystem) stops the run with one line; 0 = wait without a bound. Also orbax's own bound on an async
    # save's writes and barriers (its default: 1200 s). Multi-process runs are also bounded by
    # distributed.step_timeout_s, which counts a save as part of its step.
    timeout_s: int = 1800


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


def yaml_key(f: dataclasses.Field) -> str | None:
    """The YAML spelling of a field (`async` is a Python keyword, so its field is `async_`); None for a
    field that is no key (`ModelConfig.own`)."""
    return f.metadata.get("key", f.name)
