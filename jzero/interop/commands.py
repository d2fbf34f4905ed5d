"""`jzero ckpt import-megatron`, `export-megatron` and `megatron-names`: a Megatron run moved to jzero's
checkpoints and back, for jzero's GPT (docs/megatron.md, "Moving a run between Megatron and jzero").

The config (YAML and `--set`, as `jzero train` takes them) describes the model, its optimizer and
the mesh the state is laid out on; Megatron's names are those of its GPTModel with the local layer
spec (`gpt.megatron_names`), or a names file (`--names`). This module imports no JAX until a command
runs, so the parser costs nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jzero.config import Config, ConfigError, MlpKind, NormKind, OptimizerName, PosKind, load_config
from jzero.errors import CheckpointError
from jzero.imports import default_platforms, quiet_cuda_stub
from jzero.interop.megatron_format import refuse_to_overwrite
from jzero.paths import refuse_unwritable


def add_parsers(ckpt_sub, with_config) -> None:
    """Registers the commands under `jzero ckpt` (`ckpt_sub`: its subparsers)."""

    def common(sp) -> None:
        with_config(sp)
        sp.add_argument(
            "--names", metavar="FILE",
            help="a names file (JSON): Megatron key -> jzero param, in Megatron's registration order (default: "
            "GPTModel's local spec, as `jzero ckpt megatron-names` prints it)",
        )  # fmt: skip

    imp = ckpt_sub.add_parser(
        "import-megatron", help="a Megatron checkpoint (legacy or torch_dist) -> a new jzero checkpoint directory"
    )
    imp.add_argument("megatron", metavar="MEGATRON_CKPT", help="Megatron's --save directory or one iter_N folder")
    imp.add_argument("out", metavar="OUT_DIR", help="the jzero checkpoint directory to create (new or empty)")
    common(imp)
    imp.add_argument(
        "--bucket-size", type=int, metavar="N",
        help="the run's --ddp-bucket-size (legacy format only: it does not record its buckets)",
    )  # fmt: skip
    imp.set_defaults(fn=_cmd_import)

    exp = ckpt_sub.add_parser(
        "export-megatron", help="a jzero checkpoint -> Megatron's legacy format or torch_dist (--ckpt-format)"
    )
    exp.add_argument("dir", metavar="CKPT_DIR", help="a jzero checkpoint directory")
    exp.add_argument("out", metavar="OUT_DIR", help="Megatron's --load directory to write iter_N/ into")
    common(exp)
    exp.add_argument(
        "--bucket-size", type=int, metavar="N",
        help="the Megatron run's --ddp-bucket-size (with --overlap-grad-reduce); default: one bucket",
    )  # fmt: skip
    exp.add_argument("--step", type=int, help="the step to export (default: the newest)")
    for flag, what in (("tensor", "tensor"), ("pipeline", "pipeline (even stages)"), ("expert", "expert")):
        exp.add_argument(
            f"--{flag}-model-parallel-size", type=int, default=1, metavar="N",
            help=f"the Megatron run's {what} model-parallel size (default 1); any data-parallel size loads the files",
        )  # fmt: skip
    exp.add_argument(
        "--ckpt-format", choices=("torch", "torch_dist"), default="torch",
        help="Megatron's checkpoint format: torch (legacy, default) or torch_dist (dp_reshardable optimizer state)",
    )  # fmt: skip
    exp.add_argument(
        "--data-parallel-size", type=int, metavar="N",
        help="the Megatron run's data-parallel size (torch_dist only, required there: its buckets are padded for it)",
    )  # fmt: skip
    exp.set_defaults(fn=_cmd_export)

    names = ckpt_sub.add_parser("megatron-names", help="print the names file of the config's GPT (JSON)")
    with_config(names)
    names.set_defaults(fn=_cmd_names)


def _check_megatron_gpt(cfg: Config) -> None:
    if cfg.optimizer.name in (OptimizerName.SGD, OptimizerName.MUON, OptimizerName.OPTAX):
        raise ConfigError(
            f"optimizer.name={cfg.optimizer.name.value}: a Megatron distributed-optimizer checkpoint holds Adam's state"
        )


def _setup(args, bucket_size: int | None):
    """(config, Run without data, names tree, Megatron key order) for the command's config."""
    if bucket_size is not None and bucket_size < 1:
        raise ConfigError(f"--bucket-size {bucket_size} must be >= 1")
    cfg = load_config(args.config, args.set)
    _check_megatron_gpt(cfg)
    from jzero.runtime import start_jax

    start_jax(cfg.train.host_devices)
    from jzero.interop import gpt
    from jzero.train.loop import setup

    run = setup(cfg, with_data=False)
    mapping = gpt.read_names_file(args.names) if args.names else gpt.megatron_names(run.cfg.model)
    names, order = gpt.gpt_names(run.model.abstract_params(), mapping)
    return run.cfg, run, names, order


def _cmd_import(args) -> int:
    from jzero.interop.megatron_read import find, is_legacy

    if args.bucket_size is not None and not is_legacy(source := find(args.megatron)):
        raise ConfigError(
            f"--bucket-size {args.bucket_size} is for the legacy format, whose files do not record their buckets; "
            f"{source} is torch_dist, which does: drop --bucket-size"
        )
    refuse_unwritable(Path(args.out), f"OUT_DIR {args.out}")  # before the config, JAX and the read
    cfg, run, names, _ = _setup(args, args.bucket_size)
    _refuse_jzero_steps(Path(args.out))  # before the read
    import jax

    from jzero.interop import megatron

    flat_names = [n for r in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, megatron.Renamed)) for n in r.names]
    ck = megatron.read(args.megatron, bucket_size=args.bucket_size, names=flat_names)
    state = megatron.to_train_state(ck, run.zero, names)
    ckpt = _new_checkpoint(Path(args.out), run)
    failed = True
    try:
        ckpt.save(state, cfg)
        failed = False
    finally:
        ckpt.close(check=not failed)
    for note in [*ck.notes, *_hyperparameter_notes(ck, cfg)]:
        print(f"note: {note}")
    if cfg.model.mlp == MlpKind.GELU:
        print(TANH_GELU_NOTE, file=sys.stderr)
    print(
        f"imported Megatron iteration {ck.iteration} ({ck.format}, {len(ck.model)} params) from {ck.path} as jzero "
        f"step {ck.iteration} in {Path(args.out).resolve()}\n"
        f"continue it: jzero train {args.config or ''}{''.join(f' --set {s}' for s in args.set)} "
        f"--set checkpoint.dir={args.out} --resume   (train.steps={cfg.train.steps})"
    )
    return 0


def _refuse_jzero_steps(out: Path) -> None:
    """OUT_DIR a jzero checkpoint directory with steps: refused as the import's own (`ckpt_dir.claim` would
    refuse it too, but in `jzero train`'s words: continue it with --resume)."""
    from jzero.train import ckpt_dir

    if out.is_dir() and ckpt_dir.read_marker(out) is not None and (saved := ckpt_dir.steps(out)):
        raise CheckpointError(
            f"OUT_DIR {out} is a jzero checkpoint directory holding steps {ckpt_dir.span(saved)}: an import "
            "writes a new one; give a new or empty OUT_DIR"
        )


def _new_checkpoint(out: Path, run):
    """A Checkpointer that writes the import into OUT_DIR, a new checkpoint directory: `ckpt_dir.claim`'s refusals,
    which speak of `jzero train`'s checkpoint.dir, said of OUT_DIR."""
    from jzero.train.checkpoint import Checkpointer

    try:
        return Checkpointer(out, run, async_save=False)
    except CheckpointError as e:
        raise CheckpointError(str(e).replace("checkpoint.dir", "OUT_DIR")) from None


def _hyperparameter_notes(ck, cfg: Config) -> list[str]:
    """Where the Megatron run's Adam and LR schedule differ from the config's (jzero trains on with the config's)."""
    o = cfg.optimizer
    groups = [g for g in ck.param_groups if isinstance(g, dict)]
    decayed = next((g for g in groups if g.get("wd_mult", 1.0) == 1.0), groups[0] if groups else {})
    theirs = {
        "b1": (decayed.get("betas") or (None, None))[0], "b2": (decayed.get("betas") or (None, None))[1],
        "eps": decayed.get("eps"), "weight_decay": decayed.get("weight_decay"),
        "lr": (ck.scheduler or {}).get("max_lr", decayed.get("max_lr")),
    }  # fmt: skip
    wd = o.weight_decay if o.name == OptimizerName.ADAMW else 0.0
    ours = {"b1": o.b1, "b2": o.b2, "eps": o.eps, "weight_decay": wd, "lr": o.lr}
    differ = [f"{k} {theirs[k]} -> {ours[k]}" for k in ours if theirs[k] is not None and float(theirs[k]) != ours[k]]
    if differ:
        return [
            f"the Megatron run's optimizer differs from this config's, which jzero trains on with: {', '.join(differ)}"
        ]
    return []


def hyperparams(cfg: Config):
    """Megatron's view of the config's AdamW and LR schedule (`megatron.Hyperparams`): jzero's warmup then
    cosine decay to 10% of `optimizer.lr` at `train.steps` (`jzero.train.loop.lr_schedule`) is Megatron's
    `--lr-decay-style cosine` with those iterations."""
    from jzero.interop.megatron import Hyperparams

    o = cfg.optimizer
    return Hyperparams(
        lr=o.lr, min_lr=0.1 * o.lr, weight_decay=o.weight_decay if o.name == OptimizerName.ADAMW else 0.0,
        b1=o.b1, b2=o.b2, eps=o.eps, warmup_iters=o.warmup_steps,
        decay_iters=max(cfg.train.steps, o.warmup_steps + 1), decay_style="cosine",
        global_batch=cfg.train.global_batch, grad_dtype=cfg.precision.grad_reduce_dtype.value,
    )  # fmt: skip


# Megatron-LM's GPTModel computes the exact (erf) GELU whatever --openai-gelu says (core_v0.16.1 and main).
TANH_GELU_NOTE = (
    "jzero: note: model.mlp=gelu is GELU's tanh approximation; Megatron-LM's GPT computes the exact (erf) GELU "
    "whatever --openai-gelu says, so the run continues with another function than it trained with (model.mlp="
    "gelu_exact moves it between the two unchanged)"
)


# jzero's model.moe.aux_loss_kind -> Megatron's --moe-router-load-balancing-type
_AUX_LOSS = {"micro_batch": "aux_loss", "sequence": "seq_aux_loss", "global": "global_aux_loss"}


def megatron_flags(
    cfg: Config, bucket_size: int | None, load: str, parallel: tuple[int, int, int] = (1, 1, 1), ckpt_format="torch"
) -> str:
    """The Megatron-LM flags that describe the config's GPT, optimizer and schedule, and the export's model
    parallelism, to continue an export. `--make-vocab-size-divisible-by V/tp` makes Megatron pad any
    tokenizer's vocabulary of at most V to exactly `model.vocab_size` = V (it pads to a multiple of
    that number times tp)."""
    m, o, hp = cfg.model, cfg.optimizer, hyperparams(cfg)
    tp, pp, ep = parallel
    flags = [
        "--transformer-impl local",  # the names of GPTModel's local layer spec (Transformer Engine's differ)
        f"--num-layers {m.n_layers}", f"--hidden-size {m.d_model}", f"--num-attention-heads {m.n_heads}",
        f"--ffn-hidden-size {m.d_ff}", f"--seq-length {m.seq_len}", f"--max-position-embeddings {m.seq_len}",
        f"--make-vocab-size-divisible-by {m.vocab_size // tp}", "--attention-dropout 0 --hidden-dropout 0",
    ]  # fmt: skip
    if tp > 1 or pp > 1 or ep > 1:
        flags.append(f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}")
    if ep > 1:
        flags.append(f"--expert-model-parallel-size {ep}")
    moe = m.moe
    if moe.num_experts:
        every = [int(i % moe.every == moe.every - 1) for i in range(m.n_layers)]
        flags.append(
            f"--num-experts {moe.num_experts} --moe-router-topk {moe.top_k} --moe-router-pre-softmax "
            "--moe-token-dispatcher-type alltoall"
            + (f" --moe-layer-freq '[{','.join(map(str, every))}]'" if moe.every != 1 else "")
            + (f" --moe-expert-capacity-factor {moe.capacity_factor} --moe-token-drop-policy probs"
               if moe.capacity_factor is not None else "")
            + (f" --moe-router-load-balancing-type {_AUX_LOSS[moe.aux_loss_kind.value]} --moe-aux-loss-coeff "
               f"{moe.aux_loss_coef}" if moe.aux_loss_coef else " --moe-router-load-balancing-type none")
            + (" --moe-router-dtype fp32" if moe.router_dtype is not None and moe.router_dtype.value == "float32"
               else "")
            + (f" --moe-z-loss-coeff {moe.z_loss_coef}" if moe.z_loss_coef else "")
        )  # fmt: skip
    if m.n_kv_heads and m.n_kv_heads != m.n_heads:
        flags.append(f"--group-query-attention --num-query-groups {m.n_kv_heads}")
    if m.mlp == MlpKind.SWIGLU:
        flags.append("--swiglu")  # model.mlp=gelu_exact: Megatron's default GELU, no flag
    if m.norm == NormKind.RMSNORM:
        flags.append("--normalization RMSNorm")
    if not m.bias:
        flags.append("--disable-bias-linear")
    if m.pos == PosKind.ROPE:
        flags.append("--position-embedding-type rope")
    if not m.tie_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if cfg.precision.param_dtype.value == "bfloat16":
        flags.append("--bf16")
    flags += [
        f"--lr {hp.lr} --min-lr {hp.min_lr} --lr-decay-style cosine --lr-warmup-iters {hp.warmup_iters}",
        f"--lr-decay-iters {hp.decay_iters} --train-iters {hp.decay_iters} --weight-decay {hp.weight_decay}",
        f"--adam-beta1 {hp.b1} --adam-beta2 {hp.b2} --adam-eps {hp.eps}",
        f"--clip-grad {o.clip_grad if o.clip_grad is not None else 0.0} --global-batch-size {hp.global_batch}",
        "--use-distributed-optimizer",
        f"--overlap-grad-reduce --ddp-bucket-size {bucket_size}" if bucket_size else "",
        f"--ckpt-format {ckpt_format} --load {load} --no-load-rng",
    ]
    return " ".join(f for f in flags if f)


def megatron_args(cfg: Config, parallel: tuple[int, int, int]) -> dict:
    """The model's Megatron-LM args for a torch_dist export's `args` (Megatron-LM's `check_checkpoint_args`
    compares some with its flags): as `megatron_flags` prints them."""
    m = cfg.model
    return {
        "num_layers": m.n_layers, "hidden_size": m.d_model, "num_attention_heads": m.n_heads,
        "num_query_groups": m.n_kv_heads or m.n_heads, "group_query_attention": bool(m.n_kv_heads)
        and m.n_kv_heads != m.n_heads, "ffn_hidden_size": m.d_ff, "seq_length": m.seq_len,
        "max_position_embeddings": m.seq_len, "padded_vocab_size": m.vocab_size,
        "make_vocab_size_divisible_by": m.vocab_size // parallel[0], "add_position_embedding": m.pos != PosKind.ROPE,
        "position_embedding_type": "rope" if m.pos == PosKind.ROPE else "learned_absolute",
        "swiglu": m.mlp == MlpKind.SWIGLU, "untie_embeddings_and_output_weights": not m.tie_embeddings,
        "num_experts": m.moe.num_experts or None, "global_batch_size": cfg.train.global_batch,
        "transformer_impl": "local",
    }  # fmt: skip


def _cmd_export(args) -> int:
    parallel = _export_parallel(args)
    refuse_unwritable(Path(args.out), f"OUT_DIR {args.out}")  # these two before the config, JAX and the restore
    refuse_to_overwrite(Path(args.out), args.step, "OUT_DIR")
    cfg, run, names, order = _setup(args, args.bucket_size)
    from jzero.interop import megatron
    from jzero.train.checkpoint import Checkpointer

    reader = Checkpointer(args.dir, run, writer=False)
    try:
        state, step = _restore(reader, args.step)
    finally:
        reader.close()
    refuse_to_overwrite(Path(args.out), step, "OUT_DIR")  # the newest step's: known only now
    hp = hyperparams(cfg)
    m = cfg.model
    dist = args.ckpt_format == "torch_dist"
    folder = megatron.save(args.out, state, run.zero, names, hyperparams=hp, bucket_size=args.bucket_size, order=order,
                           parallel=parallel, query_groups=m.n_kv_heads or m.n_heads, ckpt_format=args.ckpt_format,
                           data_parallel=args.data_parallel_size,
                           model_args=megatron_args(cfg, parallel) if dist else None)  # fmt: skip
    tp, pp, ep = parallel
    ranks = f"{tp * pp * ep} model-parallel ranks (tp {tp}, pp {pp}, ep {ep}), " if tp * pp * ep > 1 else ""
    world = f"tp x pp x dp GPUs, dp a multiple of {ep}" if ep > 1 else "tp x pp x dp GPUs"
    fmt = "legacy format"
    if dist:
        world = f"tp x pp x {args.data_parallel_size} GPUs: dp {args.data_parallel_size}"
        fmt = f"torch_dist, dp_reshardable optimizer state for dp {args.data_parallel_size}"
    flags = megatron_flags(cfg, args.bucket_size, args.out, parallel, args.ckpt_format)
    print(
        f"exported jzero step {step} of {Path(args.dir).resolve()} as Megatron iteration {step}: {folder} "
        f"({ranks}{fmt})\n"
        f"continue it in Megatron-LM (pretrain_gpt.py with your data and tokenizer, on {world}; the vocabulary "
        f"padded to model.vocab_size={m.vocab_size}):\n  {flags}"
    )
    if cfg.model.mlp == MlpKind.GELU:
        print(TANH_GELU_NOTE, file=sys.stderr)
    return 0


def _restore(reader, step: int | None):
    """(state, step) of `step`, or of the newest step: a damaged one is refused naming the other steps
    `--step` exports (an export only reads the checkpoint directory: it never moves a step aside)."""
    from jzero.train import ckpt_dir
    from jzero.train.ckpt_step import DamagedStep

    steps = reader.steps()
    if step is None and not steps:
        raise CheckpointError(f"no complete checkpoint in {reader.directory}")
    step = steps[-1] if step is None else step  # one that is not there: `restore` names those that are
    try:
        return reader.restore(step), step
    except DamagedStep as e:
        others = [s for s in steps if s != step]
        hint = f"; export another of its steps with --step N ({ckpt_dir.span(others)})" if others else ""
        raise CheckpointError(f"{e}{hint}") from None


def _export_parallel(args) -> tuple[int, int, int]:
    """The receiving run's (tp, pp, ep) from the export's flags, checked against the config in `megatron.save`."""
    dp = args.data_parallel_size
    if args.ckpt_format == "torch_dist" and dp is None:
        raise ConfigError(
            "--ckpt-format torch_dist needs --data-parallel-size N, the Megatron run's data-parallel size (GPUs / "
            "(tp x pp)): torch_dist's optimizer buckets are padded for it"
        )
    if args.ckpt_format == "torch" and dp is not None:
        raise ConfigError("--data-parallel-size is for --ckpt-format torch_dist: the legacy files load at any dp")
    if dp is not None and (dp < 1 or dp % args.expert_model_parallel_size):
        raise ConfigError(
            f"--data-parallel-size {dp} must be >= 1 and a multiple of --expert-model-parallel-size "
            f"{args.expert_model_parallel_size}"
        )
    parallel = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size)
    for flag, n in zip(("tensor", "pipeline", "expert"), parallel):
        if n < 1:
            raise ConfigError(f"--{flag}-model-parallel-size {n} must be >= 1")
    return parallel


def _cmd_names(args) -> int:
    cfg = load_config(args.config, args.set)
    _check_megatron_gpt(cfg)
    default_platforms()  # names only: no GPU backend to start
    with quiet_cuda_stub():
        from jzero.interop import gpt

    print(json.dumps(gpt.megatron_names(cfg.model), indent=1))
    return 0
