"""Step time, memory and wire bytes of jzero's ZeRO stages beside plain JAX written by hand.

    python experiments/bench/run.py                     # 8 simulated CPU devices, both models
    python experiments/bench/run.py --backend gpu       # one GPU: jzero vs plain optax, tokens/s, MFU

CPU (8 simulated devices, mesh dp=8): every jzero strategy (no_shard, optim, optim_grads) on
both paths (spec, flat), built with `jzero.train.loop.setup` as `jzero train` builds it and
timed through `run.zero.step`, beside the hand-written baselines below, on two models: the
default tiny GPT and a wide, short-sequence GPT whose optimizer update is about half of DDP's step.
GPU: one device, a mesh of one: jzero's step per strategy and path against plain optax.

Equal work. jzero runs with `optimizer.clip_grad=null` (no clipping), `weight_decay_1d=true`
(every param decayed, so jzero's param groups are trivial and its AdamW is `optax.adamw`) and
`warmup_steps=0` (the first step moves the params by the full lr); the baselines build
`optax.adamw` with the same lr schedule and hyperparameters, call the model's own loss, and
return the grad norm beside the loss, as jzero's step does. Each row's first step is checked
against jzero's spec-path DDP step from the same params and batch: loss, grad norm, updated
params and Adam's moments (on GPU at full fp32 matmul precision, the timed steps at XLA's TF32
default).

Writes result.json, table.md and bench.png next to this file (or into --out).
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigError, load_config
from jzero.inspect import hlo
from jzero.mesh import DENSE_DP_AXES
from jzero.runtime import start_jax
from jzero.train import loop

HERE = Path(__file__).resolve().parent
# jzero's impls: the config overrides that make each (the defaults overlap: per-unit buckets, and ZeRO-1/2's
# params resting sharded, gathered in the forward; "no-overlap" is one whole-model bucket reduced after the
# backward and the params gathered whole after the update, as Megatron without --overlap-grad-reduce).
JZERO_IMPLS = {
    "jzero-spec": ["zero.path=spec"],
    "jzero-spec-no-overlap": ["zero.path=spec", "zero.overlap_grad_reduce=false"],
    "jzero-flat": ["zero.path=flat"],
    "jzero-flat-no-overlap": ["zero.path=flat", "zero.overlap_grad_reduce=false"],
    # the two overlaps apart: per-unit buckets reduced in the backward, the params gathered whole after the update
    "jzero-flat-no-gather-overlap": ["zero.path=flat", "zero.overlap_param_gather=false"],
}
IMPLS = (*JZERO_IMPLS, "hand-constraints", "hand-shard_map")
OPT_IN = ("jzero-flat-no-gather-overlap",)  # run only when --only names them
GPU_IMPLS = ("jzero-spec", "jzero-flat", "plain-optax")
STAGES = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2"}
HAND_STAGES = {
    "hand-constraints": ("no_shard", "optim", "optim_grads"),
    "hand-shard_map": ("optim_grads",),
    "plain-optax": ("no_shard",),
}
# Runs with the same equal-work settings (module docstring); lr decays over 1000 steps whatever --steps is.
COMMON = ["optimizer.clip_grad=null", "optimizer.weight_decay_1d=true", "optimizer.warmup_steps=0", "train.steps=1000"]
MODELS = {  # name: config overrides on configs/default.yaml
    "tiny": [],  # the default: 0.8M params, 32 x 128 tokens
    # tests/experiments/test_bench_smoke.py: the tiny GPT with one block, compiled in half the time
    "smoke": ["model.n_layers=1"],
    # 6.4M params, 8 x 8 tokens (one sequence per device): the matmuls only stream the weights, so
    # the backward costs about what the AdamW update costs, and DDP updates every param on each of the
    # 8 devices where ZeRO-1/2 update 1/8 each: the update is ~half of DDP's step (`ddp_update_share`).
    "wide": [
        "model.d_model=512",
        "model.n_heads=8",
        "model.n_layers=2",
        "model.d_ff=2048",
        "model.seq_len=8",
        "train.global_batch=8",
    ],
    # GPU: GPT-2 small (124M: GPT-2's vocabulary padded to 50304, as nanoGPT's), 16 x 1024 tokens.
    "gpt2": [
        "model.vocab_size=50304",
        "model.d_model=768",
        "model.n_heads=12",
        "model.n_layers=12",
        "model.d_ff=3072",
        "model.seq_len=1024",
        "train.global_batch=16",
    ],
    # GPU: LLaMA-3.2-1B's shape (1.24B: GQA 32/8 heads, SwiGLU, RMSNorm, RoPE, tied 128256 vocabulary), 4 x 2048
    # tokens, its 16 blocks unrolled: scanned, XLA:GPU copies each residual the backward keeps into its [L, ...]
    # stack and out again (roofline 96.6 against 83.1 ms; README.md, "Roofline"; the hand-written step calls
    # the same loss).
    "llama1b": [
        "model.vocab_size=128256",
        "model.d_model=2048",
        "model.n_heads=32",
        "model.n_kv_heads=8",
        "model.n_layers=16",
        "model.d_ff=8192",
        "model.seq_len=2048",
        "model.mlp=swiglu",
        "model.norm=rmsnorm",
        "model.bias=false",
        "model.pos=rope",
        "model.scan_layers=false",
        "train.global_batch=4",
    ],
}
H100_SXM_DENSE_BF16_TFLOPS = 989.4  # NVIDIA H100 SXM datasheet, dense (no sparsity); TF32 494.7, FP32 66.9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument(
        "--models",
        default=None,
        help="comma-separated, of: " + ", ".join(MODELS) + " (default cpu: tiny,wide; gpu: gpt2,llama1b)",
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the model's compute dtype (jzero: precision.param_dtype, fp32 main params; by hand: fp32 params cast "
        "in the loss); default cpu: float32, gpu: bfloat16, as Megatron's --bf16",
    )
    ap.add_argument(
        "--stages",
        default=None,
        help="comma-separated of no_shard, optim, optim_grads (default cpu: all; gpu: no_shard, one device's stages "
        "being the same program)",
    )
    impls = ", ".join(IMPLS + GPU_IMPLS)
    default = f"all of the backend's but {', '.join(OPT_IN)}"
    ap.add_argument("--only", default=None, help=f"comma-separated impls (default: {default}): {impls}")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps; the first is the checked one (>= 1)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--peak-tflops", type=float, default=H100_SXM_DENSE_BF16_TFLOPS, help="gpu: peak for MFU")
    ap.add_argument("--profile", type=Path, default=None, help="write each config's HLO, memory and trace here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every model's jzero and hand-written steps (repeatable)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=HERE, help="where result.json, table.md, bench.png go")
    args = ap.parse_args(argv)
    args.models = (args.models or ("tiny,wide" if args.backend == "cpu" else "gpt2,llama1b")).split(",")
    args.dtype = args.dtype or ("float32" if args.backend == "cpu" else "bfloat16")
    args.stages = tuple((args.stages or ("no_shard" if args.backend == "gpu" else ",".join(STAGES))).split(","))
    impls = IMPLS if args.backend == "cpu" else GPU_IMPLS
    args.only = tuple(args.only.split(",")) if args.only else tuple(i for i in impls if i not in OPT_IN)
    bad = [m for m in args.models if m not in MODELS] + [i for i in args.only if i not in impls]
    bad += [s for s in args.stages if s not in STAGES]
    try:
        load_config(None, args.set)
    except ConfigError as e:
        ap.error(f"--set: {e}")
    if bad or args.warmup < 1 or args.steps < 1:
        ap.error(f"unknown model/impl/stage {bad} for --backend {args.backend}" if bad else "--warmup, --steps >= 1")
    return args


def start(backend: str) -> None:
    """JAX with 8 simulated CPU devices; `--backend cpu` runs on them even on a GPU host (the platform is
    set through jax.config: JAX read the JAX_PLATFORMS variable when it was imported)."""
    if backend == "cpu":
        jax.config.update("jax_platforms", "cpu")
    start_jax(8)


# ---------------------------------------------------------------- the hand-written baselines


def adamw(cfg) -> optax.GradientTransformation:
    """optax.adamw with jzero's run's schedule and hyperparameters (`loop.lr_schedule`, written out)."""
    o = cfg.optimizer
    lr = optax.warmup_cosine_decay_schedule(
        0.0, o.lr, o.warmup_steps, max(cfg.train.steps, o.warmup_steps + 1), 0.1 * o.lr
    )
    return optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


def zero_sharding(mesh, x) -> NamedSharding:
    """`x` split over "dp" on its largest dim divisible by the dp size; replicated if none is (or a scalar)."""
    d = mesh.shape["dp"]
    dims = [i for i, n in enumerate(x.shape) if n % d == 0]
    if d == 1 or not dims:
        return NamedSharding(mesh, P())
    dim = max(dims, key=lambda i: (x.shape[i], -i))
    return NamedSharding(mesh, P(*["dp" if i == dim else None for i in range(x.ndim)]))


def hand_constraints(loss_fn, tx, mesh, params, stage: str):
    """DDP (plain jit), ZeRO-1 or ZeRO-2 by sharding constraints: (jitted step, init(params) -> state).

    step((params, opt_state), batch) -> ((params, opt_state), {loss, grad_norm}), params replicated,
    the batch [B, T+1] split over "dp". DDP constrains nothing (opt_state replicated). ZeRO-1: the
    opt_state is sharded (in/out shardings) and the params are constrained to that sharding where the
    optimizer reads them; the grads are left to XLA (sharded only where the update meets them).
    ZeRO-2: ZeRO-1 plus the grads constrained to the same sharding right after the backward. The new
    params are constrained back to replicated (the all-gather).
    """
    repl = NamedSharding(mesh, P())
    zero = jax.tree.map(lambda x: zero_sharding(mesh, x), params)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sh = jax.tree.map(lambda x: repl if stage == "no_shard" else zero_sharding(mesh, x), abstract_opt)
    wsc = jax.lax.with_sharding_constraint

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if stage == "optim_grads":
            grads = wsc(grads, zero)
        main = params if stage == "no_shard" else wsc(params, zero)
        updates, opt_state = tx.update(grads, opt_state, main)
        params = wsc(optax.apply_updates(main, updates), repl)
        return (params, opt_state), {"loss": loss, "grad_norm": optax.global_norm(grads)}

    shardings = (repl, opt_sh)
    data = NamedSharding(mesh, P("dp"))
    init = jax.jit(lambda p: (p, tx.init(p)), out_shardings=shardings)
    return jax.jit(step, in_shardings=(shardings, data), out_shardings=(shardings, repl), donate_argnums=0), init


def hand_shard_map(loss_fn, tx, mesh, params):
    """ZeRO-2 in shard_map: one psum_scatter of all grads, AdamW on the rank's flat shard, one all_gather;
    returns (jitted step, init(params) -> state).

    The opt_state is optax.adamw's on a flat [n_pad] vector split over "dp" (n_pad: the param count
    padded to a multiple of d); each rank steps its [n_pad / d] slice of the flat params.
    """
    d, n = mesh.shape["dp"], sum(x.size for x in jax.tree.leaves(params))
    shard = -(-n // d)
    specs = lambda tree: jax.tree.map(lambda x: P("dp") if x.ndim else P(), tree)  # noqa: E731
    opt_specs = specs(jax.eval_shape(tx.init, jax.ShapeDtypeStruct((shard * d,), jnp.float32)))

    def local(state, batch):  # params whole on every rank; opt_state leaves [shard]; batch [B/d, T+1]
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # this rank's grads (check_vma off: no psum)
        flat_p, unravel = ravel_pytree(params)
        pad = lambda v: jnp.pad(v, (0, shard * d - n))  # noqa: E731
        g = jax.lax.psum_scatter(pad(ravel_pytree(grads)[0]) / d, "dp", tiled=True)  # [shard]: the mean's slice
        p = jax.lax.dynamic_slice(pad(flat_p), (jax.lax.axis_index("dp") * shard,), (shard,))
        updates, opt_state = tx.update(g, opt_state, p)
        flat_p = jax.lax.all_gather(optax.apply_updates(p, updates), "dp", tiled=True)[:n]
        metrics = {"loss": jax.lax.pmean(loss, "dp"), "grad_norm": jnp.sqrt(jax.lax.psum(jnp.sum(g * g), "dp"))}
        return (unravel(flat_p), opt_state), metrics

    state_specs = (P(), opt_specs)
    step = jax.shard_map(
        local, mesh=mesh, in_specs=(state_specs, P("dp")), out_specs=(state_specs, P()), check_vma=False
    )
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs)
    init = jax.jit(lambda p: (p, tx.init(jnp.zeros(shard * d))), out_shardings=shardings)
    return jax.jit(step, donate_argnums=0), init


def hand_grads_only(loss_fn, mesh):
    """Hand DDP with the optimizer update removed: (params, batch) -> (grads, {loss, grad_norm}), replicated."""
    repl = NamedSharding(mesh, P())

    def grads(params, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        return g, {"loss": loss, "grad_norm": optax.global_norm(g)}

    return jax.jit(grads, in_shardings=(repl, NamedSharding(mesh, P("dp"))), out_shardings=repl)


# ---------------------------------------------------------------- measuring


def theory_wire_bytes(stage: str, d: int, g: float, p: float) -> float:
    """DP wire bytes per device per step in theory (ring): DDP all-reduces the grads, 2(d-1)/d G;
    ZeRO-1 and ZeRO-2 reduce-scatter the grads and all-gather the params, (d-1)/d G + (d-1)/d P."""
    one = (d - 1) / d
    return 2 * one * g if stage == "no_shard" else one * (g + p)


def dp_wire_bytes(compiled, mesh) -> dict[str, float]:
    """Per-device ring bytes of the compiled program's collectives over data-parallel axes, by kind (none on a
    mesh of one device, whose program is not read)."""
    by_kind: dict[str, float] = {}
    if mesh.size == 1:
        return by_kind
    for row in hlo.summarize(hlo.parse_collectives(compiled.as_text()), mesh):
        if row["axes"] and set(row["axes"]) <= set(DENSE_DP_AXES):
            by_kind[row["kind"]] = by_kind.get(row["kind"], 0.0) + row["wire_bytes"]
    return by_kind


def persistent_bytes(state) -> int:
    """The most bytes any one device holds of the state's arrays (params, optimizer state, main params)."""
    per_device: dict = {}
    for a in jax.tree.leaves(state):
        for s in a.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    return max(per_device.values())


def run_steps(step, state, batch, n: int) -> tuple:
    """n steps, each blocked on; returns (state, seconds per step)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return state, times


def adam_moments(opt_state) -> tuple:
    """(mu, nu) of the ScaleByAdamState inside an optax state."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    adam = next(x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x))
    return adam.mu, adam.nu


def first_step_view(impl: str, state, metrics, run) -> dict:
    """Host copies of what the check compares, in model space: loss, grad_norm, params, mu, nu."""
    if impl.startswith("jzero"):
        space = jax.jit(run.zero.to_model_space)(state.opt_state)
        # bf16 params: the fp32 main params, as the hand-written step keeps its params
        params = run.zero.full_params(state.params) if space.main_params is None else space.main_params
        mu, nu = adam_moments(space.inner_state)
    else:
        params, opt_state = state
        mu, nu = adam_moments(opt_state)
        if impl == "hand-shard_map":  # flat [n_pad] -> per param
            flat, unravel = ravel_pytree(jax.device_get(params))
            mu, nu = (unravel(np.asarray(v)[: flat.size]) for v in (mu, nu))
    view = jax.device_get({"params": params, "mu": mu, "nu": nu})
    return {**view, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


# bf16: a grad rounds to 8 mantissa bits (2^-8 relative) where each program's fusions put the cast, twice that on
# Adam's nu (g^2); 2^-5 leaves two such roundings on nu.
CHECK_RTOL = {"float32": 1e-5, "bfloat16": 2**-5}
TINY_GRAD = 1e-5  # 1000 x Adam's eps: below it, Adam's first step g / (|g| + eps) amplifies rounding in g


def check(view: dict, ref: dict, b1: float, rtol: float) -> dict:
    """Largest relative difference to the reference per quantity, and whether all are within `rtol`.

    Arrays are compared per tensor against the tensor's largest magnitude (the rounding of a summed
    grad is relative to its terms, not to an element that nearly cancels). Params are compared where
    the reference grad |g| = |mu| / (1 - b1) exceeds TINY_GRAD and `rtol` times its tensor's largest: on
    a grad of rounding-noise size Adam's first update g / (|g| + eps) is any value in (-1, 1) (seen: a 1.6%
    change of a 2e-8 grad moved its param by 1e-5; in bf16 a grad under 1% of its tensor's largest can
    change sign between two programs); mu and nu check every element's grad.
    """
    out = {k: abs(view[k] - ref[k]) / abs(ref[k]) for k in ("loss", "grad_norm")}
    rel = lambda a, b, m=True: float(np.max(np.abs(a - b) * m, initial=0) / max(np.max(np.abs(b)), 1e-30))  # noqa: E731
    for k in ("mu", "nu"):
        out[k] = max(jax.tree.leaves(jax.tree.map(rel, view[k], ref[k])))
    big = jax.tree.map(lambda mu: np.abs(mu) > max(TINY_GRAD * (1 - b1), rtol * np.max(np.abs(mu))), ref["mu"])
    out["params"] = max(jax.tree.leaves(jax.tree.map(rel, view["params"], ref["params"], big)))
    skipped = sum(int(np.size(m) - np.sum(m)) for m in jax.tree.leaves(big))
    return {"max_rel_diff": out, "params_skipped_tiny_grad": skipped, "ok": all(v <= rtol for v in out.values())}


def profile_files(directory: Path, name: str, compiled) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.hlo.txt").write_text(compiled.as_text())
    mem = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    (directory / f"{name}.memory.json").write_text(json.dumps({f: getattr(mem, f, None) for f in fields}, indent=1))


def prepare(name: str, step, state, batch, run, args) -> dict:
    """Compiles one config and runs its warm-up steps, the first of them checked: a dict holding the
    compiled step, its live state and batch, compile seconds, persistent bytes and the first-step view."""
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    c = {
        "name": name,
        "compiled": compiled,
        "batch": batch,
        "times": [],
        "compile_s": time.perf_counter() - t0,
        "persistent_bytes": persistent_bytes(state),
    }
    if args.backend == "gpu" and args.dtype == "float32":
        # XLA:GPU computes fp32 dots in TF32 by default, rounded differently with each program's layout
        # (2.7e-4 apart on an H100): the checked step is the same program at full fp32, the timed ones
        # are the default.
        with jax.default_matmul_precision("highest"):
            state, metrics = step.lower(state, batch).compile()(state, batch)
    else:
        state, metrics = compiled(state, batch)
    c["view"] = first_step_view(name.split("/")[1], state, metrics, run)
    c["state"], _ = run_steps(compiled, state, batch, args.warmup - 1)
    if args.profile:
        profile_files(args.profile, name.replace("/", "."), compiled)
    return c


def time_interleaved(configs: list[dict], steps: int, profile: Path | None, model: str) -> None:
    """`steps` rounds, each one timed step of every config in turn: drift in the machine's load
    (a shared machine) then falls on every config alike instead of on whichever ran last."""
    trace = jax.profiler.trace(str(profile / "trace" / model)) if profile else contextlib.nullcontext()
    with trace:
        for _ in range(steps):
            for c in configs:
                c["state"], t = run_steps(c["compiled"], c["state"], c["batch"], 1)
                c["times"] += t


def stats(times_ms: list[float]) -> dict:
    p10, med, p90 = np.percentile(times_ms, [10, 50, 90])
    return {"median_ms": float(med), "p10_ms": float(p10), "p90_ms": float(p90)}


# ---------------------------------------------------------------- one model


def model_flops_per_token(cfg, n_params: int) -> float:
    """nanoGPT's estimate_mfu (PaLM, appendix B): 6N + 12 L d_model T, N without the position embeddings."""
    m = cfg.model
    return 6 * n_params + 12 * m.n_layers * m.d_model * m.seq_len


def hand_loss(loss_fn, dtype: str):
    """The model's loss as a user writes mixed precision by hand: fp32 params, cast to `dtype` inside the loss
    (their grads come back fp32 through the cast), as Megatron's --bf16 keeps fp32 main params."""
    if dtype == "float32":
        return loss_fn
    return lambda params, batch: loss_fn(jax.tree.map(lambda x: x.astype(dtype), params), batch)


def build(impl: str, strategy: str, overrides, devices, base, tx, init_params, hand_batch, dtype: str):
    """(step, initial state, batch, run) of one config; run is jzero's `loop.Run` (None by hand)."""
    if impl.startswith("jzero"):
        cfg = load_config(None, [*overrides, f"zero.strategy={strategy}", *JZERO_IMPLS[impl]])
        run = loop.setup(cfg, devices, with_data=False)
        return run.zero.step, run.init_state(), base.device_batch(0), run
    loss_fn = hand_loss(base.model.loss, dtype)
    if impl == "hand-shard_map":
        step, init = hand_shard_map(loss_fn, tx, base.mesh, init_params)
    else:
        step, init = hand_constraints(loss_fn, tx, base.mesh, init_params, strategy)
    return step, init(jax.device_put(init_params, NamedSharding(base.mesh, P()))), hand_batch, None


def bench_model(model: str, args, devices) -> dict:
    d = len(devices)
    overrides = [*COMMON, *MODELS[model], f"mesh.dp={d}", f"precision.param_dtype={args.dtype}", *args.set]
    base = loop.setup(load_config(None, [*overrides, "zero.strategy=no_shard", "zero.path=spec"]), devices)
    cfg, mesh = base.cfg, base.mesh
    # fp32 for the hand-written steps: their master params (jzero's main params start from the same values)
    init_params = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(base.init_state().params))
    n = sum(x.size for x in jax.tree.leaves(init_params))
    g_bytes = p_bytes = 4 * n  # fp32 grads and params, tp = 1
    tx = adamw(cfg)
    hand_batch = jax.device_put(base.device_batch(0), NamedSharding(mesh, P("dp")))
    impls = GPU_IMPLS if args.backend == "gpu" else IMPLS
    todo = [("jzero-spec", "no_shard")]  # first: its first step is every check's reference
    todo += [
        (i, s)
        for i in JZERO_IMPLS
        if i in impls
        for s in STAGES
        if s in args.stages and (i, s) != todo[0] and not (i == "jzero-flat-no-gather-overlap" and s == "no_shard")
    ]  # DDP gathers no params
    todo += [(impl, s) for impl, stages in HAND_STAGES.items() if impl in impls for s in stages if s in args.stages]
    configs, ref = [], None  # jzero-spec DDP comes first: its first step is the reference of every check
    for impl, strategy in todo:
        is_ref = (impl, strategy) == ("jzero-spec", "no_shard")
        if impl not in args.only and not is_ref:
            continue
        step, state, batch, run = build(
            impl, strategy, overrides, devices, base, tx, init_params, hand_batch, args.dtype
        )
        name = f"{model}/{impl}/{STAGES[strategy]}"
        c = prepare(name, step, state, batch, run, args)
        print(f"prepared {name}: compile {c['compile_s']:.1f} s", file=sys.stderr, flush=True)
        ref = c["view"] if is_ref else ref
        c["check"] = check(c.pop("view"), ref, cfg.optimizer.b1, CHECK_RTOL[args.dtype])  # host copies dropped
        if impl in args.only:
            configs.append({**c, "impl": impl, "strategy": strategy, "mesh": mesh})
    grads_only = None
    if any(c["impl"] in ("hand-constraints", "plain-optax") for c in configs):
        loss_fn = hand_loss(base.model.loss, args.dtype)
        grads_only = prepare_grads_only(loss_fn, mesh, init_params, hand_batch, args, model)
    time_interleaved(configs + ([grads_only] if grads_only else []), args.steps, args.profile, model)
    rows = [make_row(c, model, cfg, d, g_bytes, p_bytes, n, init_params, args) for c in configs]
    out = {
        "params": n,
        "config_overrides": overrides,
        "d": d,
        "grad_bytes": g_bytes,
        "param_bytes": p_bytes,
        "tokens_per_step": cfg.train.global_batch * cfg.model.seq_len,
        "rows": rows,
    }
    if grads_only:
        t = stats([1e3 * x for x in grads_only["times"]])["median_ms"]
        ddp = {r["impl"]: r["median_ms"] for r in rows if r["stage"] == "DDP"}
        out["ddp_update_share"] = {"grads_only_median_ms": t, **{f"vs_{i}": 1 - t / ms for i, ms in ddp.items()}}
    return out


def prepare_grads_only(loss_fn, mesh, init_params, batch, args, model: str) -> dict:
    """The hand DDP step without the optimizer update, as a config to time: DDP's update share is
    1 - (its time) / (a DDP step's time)."""
    compiled = hand_grads_only(loss_fn, mesh).lower(init_params, batch).compile()
    params = jax.device_put(init_params, NamedSharding(mesh, P()))
    step = lambda s, b: (s, compiled(s, b))  # noqa: E731
    state, _ = run_steps(step, params, batch, args.warmup)
    return {
        "name": f"{model}/hand DDP without the update",
        "compiled": step,
        "state": state,
        "batch": batch,
        "times": [],
    }


def make_row(c: dict, model, cfg, d, g_bytes, p_bytes, n, init_params, args) -> dict:
    strategy = c["strategy"]
    wire_by_kind = dp_wire_bytes(c["compiled"], c["mesh"])
    wire, theory = sum(wire_by_kind.values()), theory_wire_bytes(strategy, d, g_bytes, p_bytes)
    times = [1e3 * t for t in c["times"]]
    row = {
        "model": model,
        "impl": c["impl"],
        "stage": STAGES[strategy],
        "strategy": strategy,
        **stats(times),
        "compile_s": c["compile_s"],
        "persistent_bytes": c["persistent_bytes"],
        "dp_wire_bytes": wire,
        "dp_wire_by_kind": wire_by_kind,
        "theory_wire_bytes": theory,
        "wire_ratio_to_theory": wire / theory if theory else None,
        "check": c["check"],
        "step_ms": times,
    }
    row["tokens_per_s"] = cfg.train.global_batch * cfg.model.seq_len / (row["median_ms"] / 1e3)
    if args.backend == "gpu":
        n_flops = n - (init_params["pos_emb"].size if "pos_emb" in init_params else 0)
        row["mfu"] = model_flops_per_token(cfg, n_flops) * row["tokens_per_s"] / (args.peak_tflops * 1e12)
    print(_progress_line(row), file=sys.stderr, flush=True)
    return row


def _progress_line(r: dict) -> str:
    c = r["check"]
    worst = max(c["max_rel_diff"].values())
    return (
        f"{r['model']:>5} {r['impl']:<16} {r['stage']:<7} {r['median_ms']:9.1f} ms  compile {r['compile_s']:5.1f} s"
        f"  state {r['persistent_bytes'] / 2**20:8.2f} MiB  wire {r['dp_wire_bytes'] / 2**20:8.2f} MiB"
        f"  check {'ok' if c['ok'] else 'FAILED'} ({worst:.1e})"
    )


# ---------------------------------------------------------------- ratios, table, plot


def add_ratios(rows: list[dict]) -> None:
    """Ratios of each row to: its family's DDP, jzero-spec DDP, and each hand-written impl of its stage."""
    at = {(r["impl"], r["stage"]): r for r in rows}
    for r in rows:
        hand_ddp = next((i for i in ("hand-constraints", "plain-optax") if (i, "DDP") in at), None)
        family = r["impl"] if r["impl"].startswith("jzero") else hand_ddp
        ddp = at.get((family, "DDP"))
        spec_ddp = at.get(("jzero-spec", "DDP"))
        r["family_ddp"] = family
        r["ratio_to_ddp"] = r["median_ms"] / ddp["median_ms"] if ddp else None
        r["ratio_to_jzero_spec_ddp"] = r["median_ms"] / spec_ddp["median_ms"] if spec_ddp else None
        r["persistent_ratio_to_ddp"] = r["persistent_bytes"] / ddp["persistent_bytes"] if ddp else None
        r["ratio_to_hand"] = {}
        for impl in HAND_STAGES:  # plain optax (a mesh of one: every stage is DDP) stands for every stage
            hand = at.get((impl, "DDP" if impl == "plain-optax" else r["stage"]))
            if hand:
                r["ratio_to_hand"][impl] = r["median_ms"] / hand["median_ms"]


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _check_cell(c: dict) -> str:
    return ("ok" if c["ok"] else "FAILED") + f" {max(c['max_rel_diff'].values()):.0e}"


def table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# experiments/bench: {result['backend']}, {m['devices']} x {m['device_kind']}, {m['cpu']} "
        f"({m['cores']} cores), jax {m['jax']}, {m['date']}",
        "",
    ]
    hands = [i for i in HAND_STAGES if any(r["impl"] == i for mod in result["models"].values() for r in mod["rows"])]
    for model, doc in result["models"].items():
        lines += [f"## {model}: {doc['params']:,} params, {doc['tokens_per_step']} tokens/step, d = {doc['d']}", ""]
        cols = [
            "impl",
            "stage",
            "median ms (p10-p90)",
            "x DDP",
            "x jzero-spec DDP",
            *[f"x {h}" for h in hands],
            "state MiB (x DDP)",
            "DP wire MiB (/ theory)",
            "compile s",
            "check",
        ]
        if result["backend"] == "gpu":
            cols[-1:-1] = ["tokens/s", "MFU"]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in doc["rows"]:
            cells = [
                r["impl"],
                r["stage"],
                f"{r['median_ms']:.1f} ({r['p10_ms']:.1f}-{r['p90_ms']:.1f})",
                _f(r["ratio_to_ddp"]),
                _f(r["ratio_to_jzero_spec_ddp"]),
                *[_f(r["ratio_to_hand"].get(h)) for h in hands],
                f"{r['persistent_bytes'] / 2**20:.2f} ({_f(r['persistent_ratio_to_ddp'])})",
                f"{r['dp_wire_bytes'] / 2**20:.2f} ({_f(r['wire_ratio_to_theory'])})",
                f"{r['compile_s']:.1f}",
                _check_cell(r["check"]),
            ]
            if result["backend"] == "gpu":
                cells[-1:-1] = [f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}"]
            lines.append("| " + " | ".join(cells) + " |")
        share = doc.get("ddp_update_share")
        if share:
            parts = ", ".join(f"{v:.0%} of {k[3:]} DDP" for k, v in share.items() if k.startswith("vs_"))
            lines += [
                "",
                f"DDP's optimizer update: {parts} (hand DDP without the update: "
                f"{share['grads_only_median_ms']:.1f} ms).",
            ]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    present = {r["impl"] for m in models for r in result["models"][m]["rows"]}
    impls = [i for i in (*IMPLS, "plain-optax") if i in present]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    width = 0.8 / len(impls)
    for ax, model in zip(axes[0], models):
        rows = {(r["impl"], r["stage"]): r for r in result["models"][model]["rows"]}
        for k, impl in enumerate(impls):
            for s, stage in enumerate(STAGES.values()):
                r = rows.get((impl, stage))
                if r is None:
                    continue
                err = [[r["median_ms"] - r["p10_ms"]], [r["p90_ms"] - r["median_ms"]]]
                ax.bar(
                    s + (k - (len(impls) - 1) / 2) * width,
                    r["median_ms"],
                    width * 0.9,
                    yerr=err,
                    capsize=2,
                    color=f"C{k}",
                    label=impl if s == 0 or (impl, "DDP") not in rows else None,
                )
        ax.set_xticks(range(len(STAGES)), list(STAGES.values()))
        ax.set_ylabel("median step time (ms), whiskers p10-p90")
        ax.set_title(f"{model} ({result['models'][model]['params'] / 1e6:.1f}M params)")
        ax.set_ylim(0, 1.3 * max(r["p90_ms"] for r in rows.values()))
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    m = result["machine"]
    fig.suptitle(f"Step time per ZeRO stage: {m['devices']} x {m['device_kind']} on {m['cores']} cores ({m['cpu']})")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def machine(devices) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(args.backend)
    if args.backend == "gpu":
        if jax.default_backend() != "gpu":
            print(f"warning: --backend gpu but JAX's backend is {jax.default_backend()}", file=sys.stderr)
        devices = jax.devices()[:1]
    else:
        devices = jax.devices("cpu")[:8]
    t0 = time.perf_counter()
    result = {
        "backend": args.backend,
        "machine": machine(devices),
        "warmup": args.warmup,
        "steps": args.steps,
        "dtype": args.dtype,
        "stages": list(args.stages),
        "check_rtol": CHECK_RTOL[args.dtype],
        "models": {},
    }
    for model in args.models:
        result["models"][model] = doc = bench_model(model, args, devices)
        add_ratios(doc["rows"])
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (args.out / "table.md").write_text(text)
    plot(result, args.out / "bench.png")
    print(f"\n{text}\nwrote {args.out}/result.json, table.md, bench.png in {result['wall_s']:.0f} s", file=sys.stderr)
    failed = [
        f"{m}/{r['impl']}/{r['stage']}"
        for m, doc in result["models"].items()
        for r in doc["rows"]
        if not r["check"]["ok"]
    ]
    if failed:
        print(f"first-step check failed (rtol {CHECK_RTOL[args.dtype]}): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
