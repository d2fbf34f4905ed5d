"""The GPU bench's steps at the roofline, deviceless: where one GPU's step time goes, from the compiled program.

    python experiments/bench/roofline.py                       # gpt2 and llama1b on one H200, bf16
    python experiments/bench/roofline.py --target h100 --models llama1b --set model.scan_layers=true

The programs `run.py --backend gpu` times (jzero's spec and flat steps, plain optax by hand; one device, bf16,
cuDNN's attention), compiled for a card this machine does not have and read by `jzero.inspect.roofline`: each
kernel at the larger of its matmuls at the card's peak (fp32 ones at half) and its HBM bytes at the card's
bandwidth. Per row: the roofline step time, the matmul flops and those on fp32 operands, the HBM bytes, XLA's
temp, the MFU and tokens/s the step would reach at its roofline, and its time over plain optax's. Compare rows
with each other and with a measured run's ratio to its roofline (README.md, "Roofline"); the roofline does not
predict a profile.

Writes roofline.json and roofline.md next to this file (or into --out).
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigError, load_config
from jzero.inspect import compile as inspect_compile
from jzero.inspect.roofline import roofline
from jzero.inspect.targets import TARGETS
from jzero.inspect.timing import LINKS
from jzero.runtime import start_jax

sys.path.insert(0, str(Path(__file__).parent))
import run as bench  # noqa: E402  (the GPU bench's models, settings and hand-written step)

HERE = Path(__file__).parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--target", default="h200", choices=sorted(LINKS), help="the card (default h200, as recorded)")
    ap.add_argument("--models", default="gpt2,llama1b", help="comma-separated, of: " + ", ".join(bench.MODELS))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="as run.py's --dtype")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak (default: jzero's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every model's steps (repeatable), as run.py's")  # fmt: skip
    ap.add_argument("--out", type=Path, default=HERE, help="where roofline.json and roofline.md go")
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    bad = [m for m in args.models if m not in bench.MODELS]
    try:
        load_config(None, args.set)
    except ConfigError as e:
        ap.error(f"--set: {e}")
    if bad:
        ap.error(f"unknown model(s) {bad}")
    return args


def plain_optax(run, cfg):
    """The bench's plain optax by hand (`run.hand_constraints`, DDP) on the run's deviceless mesh: (step, args)."""
    mesh, repl = run.mesh, NamedSharding(run.mesh, P())
    state = inspect_compile.abstract_state(run)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=repl), state.params)
    tx = bench.adamw(cfg)
    step, _ = bench.hand_constraints(bench.hand_loss(run.model.loss, cfg.precision.param_dtype.value), tx, mesh,
                                     params, "no_shard")  # fmt: skip
    opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=repl), jax.eval_shape(tx.init, params))
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=NamedSharding(mesh, P("dp")))  # fmt: skip
    return step, ((params, opt), batch)


def bench_model(model: str, args) -> list[dict]:
    overrides = [*bench.COMMON, *bench.MODELS[model], "mesh.dp=1", f"precision.param_dtype={args.dtype}",
                 "zero.strategy=no_shard", *args.set]  # fmt: skip
    peak = LINKS[args.target].peak_flops if args.peak_tflops is None else args.peak_tflops * 1e12
    bandwidth = TARGETS[args.target].hbm_bandwidth
    compiled, run = {}, None
    for impl in ("jzero-spec", "jzero-flat"):
        cfg = load_config(None, [*overrides, *bench.JZERO_IMPLS[impl]])
        c = inspect_compile.compile_step(cfg, args.target, "1 x 1 x 1", dump=False)
        compiled[impl], run = c.compiled, c.run
    step, step_args = plain_optax(run, run.cfg)
    compiled["plain-optax"] = step.lower(*step_args).compile()
    cfg = run.cfg
    tokens = cfg.train.global_batch * cfg.model.seq_len
    params = inspect_compile.abstract_state(run).params
    n = sum(x.size for x in jax.tree.leaves(params)) - (params["pos_emb"].size if "pos_emb" in params else 0)
    flops_per_token = bench.model_flops_per_token(cfg, n)  # as run.py's MFU: N without the position embeddings
    rows = []
    for impl, c in compiled.items():
        r = roofline(c.as_text(), peak, bandwidth)
        rows.append({
            "model": model, "impl": impl, "roofline_ms": 1e3 * r.seconds, "dot_tflop": r.dot_flops / 1e12,
            "fp32_dot_tflop": r.fp32_dot_flops / 1e12, "hbm_gb": r.hbm_bytes / 1e9,
            "temp_gib": c.memory_analysis().temp_size_in_bytes / 2**30,
            "tokens_per_s": tokens / r.seconds, "mfu": flops_per_token * tokens / r.seconds / peak,
        })  # fmt: skip
        print(f"{model}/{impl}: roofline {rows[-1]['roofline_ms']:.1f} ms", file=sys.stderr, flush=True)
    plain = rows[-1]["roofline_ms"]
    for row in rows:
        row["x_plain_optax"] = row["roofline_ms"] / plain  # step time over plain optax's, as run.py's table
    return rows


def table(rows: list[dict]) -> str:
    head = "| model | impl | roofline ms/step "
    head += "| matmul TFLOP (fp32) | HBM GB | temp GiB | MFU at roofline | x plain-optax (ms) |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['roofline_ms']:.1f} | {r['dot_tflop']:.1f} ({r['fp32_dot_tflop']:.2f}) "
            f"| {r['hbm_gb']:.1f} | {r['temp_gib']:.2f} | {100 * r['mfu']:.1f}% | {r['x_plain_optax']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    start_jax(1)
    rows = [row for model in args.models for row in bench_model(model, args)]
    meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "target": args.target,
            "dtype": args.dtype, "set": args.set, "hbm_bandwidth": TARGETS[args.target].hbm_bandwidth}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roofline.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (args.out / "roofline.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
