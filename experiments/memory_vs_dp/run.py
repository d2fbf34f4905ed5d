"""LLaMA-2 bytes per device vs data-parallel size, per ZeRO stage: compiled program vs formula,
and the seed's memory tables (the design document jzero started from; quoted below) next to
what the compiled programs say.

    python experiments/memory_vs_dp/run.py [--replot]

Everything is compiled deviceless for H100s (docs/xla.md, "Deviceless GPU compilation"); nothing runs. Writes
`result.json`, `tables.md` (the tables of the README) and `memory_vs_dp.png`. About 27
minutes on 2 busy CPU cores (74 compiles); needs `pip install -e .[experiments,gpu-aot]`. `--replot` redraws the
tables and the plot from `result.json` without compiling.
"""

import json
import os
import sys
import time
from pathlib import Path

import jax

from jzero.config import load_config
from jzero.inspect import memory
from jzero.inspect.compile import compile_step, with_zero
from jzero.inspect.targets import TARGETS
from jzero.runtime import start_jax

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[1] / "configs"
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
LABEL = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}
DPS = (1, 2, 4, 8, 16, 32, 64)
MICROBATCHES = (1, 8)  # one micro-batch per step, or 8 accumulated (where ZeRO-2's sharded accumulator shows)
H100 = TARGETS["h100"].memory_bytes
GB = 1e9  # the seed's unit

# Quoted from the seed's "Performance Analysis", "Memory Savings by Model Size" (H100 80GB, "FP16", Adam):
# (model, dp, strategy, params, grads, optimizer states, total GB, savings / verdict)
SEED_SAVINGS = [
    ("7b", 1, "no_shard", 14, 14, 84, 112, "-"),
    ("7b", 8, "optim", 14, 14, 10.5, 38.5, "66%"),
    ("7b", 8, "optim_grads", 14, 1.75, 10.5, 26.25, "77%"),
    ("70b", 16, "no_shard", 140, 140, 840, 1120, "OOM!"),
    ("70b", 16, "optim", 140, 140, 52.5, 332.5, "OOM!"),
    ("70b", 32, "optim", 140, 140, 26.25, 306.25, "OOM!"),
    ("70b", 64, "optim", 140, 140, 13.1, 293.1, "OOM!"),
    ("70b", 64, "optim_grads", 140, 2.2, 13.1, 155.3, "OK!"),
]
# Same document, "Scaling Efficiency" (LLaMA-70B, global batch 1024): (dp, GPUs, per-GPU batch, memory/GPU)
SEED_SCALING = [(16, 64, 64, "OOM"), (32, 128, 32, "160 GB"), (64, 256, 16, "155 GB"), (128, 512, 8, "152 GB")]


def compile_memory(name: str, overrides: list[str], strategy: str, topology: str | None = None) -> dict:
    """`jzero memory configs/<name>.yaml --target h100 [--topology ...] --set ...` for one strategy, as a dict."""
    cfg = with_zero(load_config(CONFIGS / f"{name}.yaml", overrides), strategy)
    c = compile_step(cfg, "h100", topology, dump=False)
    doc = memory.analyze(c, H100)
    doc["topology"] = c.topology
    return doc


def vs_dp() -> dict:
    """LLaMA-2-7B as configured (bf16 params, fp32 grads), micro-batch 1 x 4096 tokens per GPU;
    keys "<microbatches>/<dp>/<strategy>"."""
    out = {}
    for m in MICROBATCHES:
        for dp in DPS:
            for s in STRATEGIES:
                t0 = time.perf_counter()
                over = [f"mesh.dp={dp}", f"train.global_batch={dp * m}", f"train.microbatches={m}"]
                doc = out[f"{m}/{dp}/{s}"] = compile_memory("llama2_7b", over, s)
                print(
                    f"7b microbatches={m} dp={dp} {s}: peak {doc['compiled']['peak'] / 2**30:.1f} GiB "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return out


def seed_savings() -> list[dict]:
    """The seed's rows compiled with the seed's byte counts: 2-byte params AND grads (its "FP16";
    jzero's 2-byte float is bf16), fp32 main params and Adam moments; tp = 1 as the seed has it."""
    rows = []
    for model, dp, s, *seed in SEED_SAVINGS:
        over = [f"mesh.dp={dp}", "mesh.tp=1", f"train.global_batch={dp}", "precision.grad_reduce_dtype=bfloat16"]
        doc = compile_memory(f"llama2_{model}", over, s)
        rows.append({"model": model, "dp": dp, "strategy": s, "seed": dict(zip(
            ("params", "grads", "optimizer", "total", "verdict"), seed)), "jzero": doc})  # fmt: skip
        print(f"seed row {model} dp={dp} {s}: done", flush=True)
    return rows


def seed_scaling() -> list[dict]:
    """The scaling rows: 70B on dp x 4 GPUs (the seed's GPUs / DP), tp=4, Megatron's bf16 recipe
    (fp32 grads), micro-batch 1 accumulated to the seed's per-GPU batch."""
    rows = []
    for dp, gpus, per_gpu, seed_mem in SEED_SCALING:
        over = [f"mesh.dp={dp}", "mesh.tp=4", f"train.global_batch={dp * per_gpu}", f"train.microbatches={per_gpu}"]
        docs = {s: compile_memory("llama2_70b", over, s) for s in ("optim", "optim_grads")}
        rows.append({"dp": dp, "gpus": gpus, "per_gpu_batch": per_gpu, "seed_memory": seed_mem, "jzero": docs})
        print(f"scaling row dp={dp}: done", flush=True)
    return rows


def llama3_405b() -> dict:
    """configs/llama3_405b.yaml (405.85B params, tp=8) on 1024 H100s (128 hosts of 8, dp=128): ZeRO-2 vs ZeRO-3."""
    out = {}
    for s in ("optim_grads", "optim_grads_params"):
        t0 = time.perf_counter()
        doc = out[s] = compile_memory("llama3_405b", [], s, topology="1 x 128 x 8")
        peak = doc["compiled"]["peak"] / 2**30
        print(f"405b {s}: peak {peak:.1f} GiB ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


# --------------------------------------------------------------------------- output


def gb(n: float) -> str:
    return f"{n / GB:.2f}"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def tables(result: dict) -> str:
    lines = ["### LLaMA-2-7B on H100s, per device (GiB): Megatron formula, compiled peak with 1 and 8 micro-batches\n",
             "bf16 params, fp32 grads, fp32 main params + Adam; micro-batch 1 x 4096 tokens, remat; "
             "**bold**: does not fit an 80 GB H100 (79.1 GiB).\n",
             "| dp | " + " | ".join(f"{LABEL[s]} formula | peak M=1 | peak M=8" for s in STRATEGIES) + " |",
             "|---:|" + "---:|---:|---:|" * len(STRATEGIES)]  # fmt: skip
    vs = result["llama7b_vs_dp"]
    for dp in DPS:
        cells = []
        for s in STRATEGIES:
            cells.append(gib(vs[f"1/{dp}/{s}"]["formula"]["total"]))
            for m in MICROBATCHES:
                d = vs[f"{m}/{dp}/{s}"]
                cells.append(gib(d["compiled"]["peak"]) if d["fits"] else f"**{gib(d['compiled']['peak'])}**")
        lines.append(f"| {dp} | " + " | ".join(cells) + " |")
    if "llama3_405b" in result:
        lines += ["", "### LLaMA-3.1-405B-shaped on 1024 H100s (tp=8, dp=128), per device (GiB)\n",
                  "| stage | params | main params + Adam | grads | state = formula | temp | peak | fits 80 GB H100? |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for s, d in result["llama3_405b"].items():
            st, cb = d["state"], d["compiled"]
            same = "=" if abs(st["total"] - d["formula"]["total"]) < 64 else "!="
            lines.append(
                f"| {LABEL[s]} | {gib(st['params'])} | {gib(st['main_params'] + st['optimizer_moments'])} "
                f"| {gib(st['grads'])} | {gib(st['total'])} {same} {gib(d['formula']['total'])} | {gib(cb['temp'])} "
                f"| {gib(cb['peak'])} | {'yes' if d['fits'] else 'no'} |"
            )
    lines += ["", "### The seed's \"Memory Savings by Model Size\", beside the compiled programs (GB = 1e9 bytes)\n",
              "jzero compiled with the seed's bytes: 2-byte params and grads (bf16), fp32 main params + Adam, tp=1.\n",
              "| model | dp | stage | seed params / grads / opt / total | jzero state params / grads / opt / total "
              "| compiled peak | seed verdict | fits 80 GB H100? |",
              "|---|---:|---|---|---|---:|---|---|"]  # fmt: skip
    for r in result["seed_savings"]:
        sd, st = r["seed"], r["jzero"]["state"]
        opt = st["main_params"] + st["optimizer_moments"]
        lines.append(
            f"| LLaMA-{r['model'].upper()} | {r['dp']} | {LABEL[r['strategy']]} "
            f"| {sd['params']} / {sd['grads']} / {sd['optimizer']} / {sd['total']} "
            f"| {gb(st['params'])} / {gb(st['grads'])} / {gb(opt)} / {gb(st['total'])} "
            f"| {gb(r['jzero']['compiled']['peak'])} | {sd['verdict']} | {'yes' if r['jzero']['fits'] else 'no'} |"
        )
    lines += ["", "### The seed's \"Scaling Efficiency\" memory column (LLaMA-70B), beside the compiled programs\n",
              "jzero: tp = GPUs / dp = 4, bf16 params, fp32 grads, micro-batch 1 accumulated to the per-GPU batch.\n",
              "| dp | GPUs | seed memory/GPU | ZeRO-1 state / peak (GB) | ZeRO-2 state / peak (GB) "
              "| fits 80 GB H100? |",
              "|---:|---:|---|---|---|---|"]  # fmt: skip
    for r in result["seed_scaling"]:
        z1, z2 = r["jzero"]["optim"], r["jzero"]["optim_grads"]
        fits = f"ZeRO-1 {'yes' if z1['fits'] else 'no'}, ZeRO-2 {'yes' if z2['fits'] else 'no'}"
        lines.append(
            f"| {r['dp']} | {r['gpus']} | {r['seed_memory']} "
            f"| {gb(z1['state']['total'])} / {gb(z1['compiled']['peak'])} "
            f"| {gb(z2['state']['total'])} / {gb(z2['compiled']['peak'])} | {fits} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, m in zip(axes, MICROBATCHES):
        colors, shifts = ("#4c72b0", "#dd8452", "#55a868", "#c44e52"), (1.0, 0.985, 1.015, 1.03)
        for s, color, shift in zip(STRATEGIES, colors, shifts):
            docs = [result["llama7b_vs_dp"][f"{m}/{dp}/{s}"] for dp in DPS]
            x = [dp * shift for dp in DPS]  # the stages' lines often coincide: nudge them apart
            ax.plot(
                x, [d["compiled"]["peak"] / 2**30 for d in docs], "-o", color=color, label=f"{LABEL[s]}: compiled peak"
            )
            ax.plot(x, [d["formula"]["total"] / 2**30 for d in docs], "--", color=color, label=f"{LABEL[s]}: formula")
            ax.plot(
                x,
                [d["compiled"]["argument"] / 2**30 for d in docs],
                ":",
                color=color,
                label=f"{LABEL[s]}: compiled arguments (state)",
            )
        ax.axhline(H100 / 2**30, color="red", lw=1)
        ax.text(1, H100 / 2**30 + 2, "H100 80GB", color="red", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(DPS, [str(d) for d in DPS])
        ax.set_xlabel("data-parallel size d (H100s)")
        ax.set_title(f"{m} micro-batch{'es' if m > 1 else ''} of 1 x 4096 tokens per step", fontsize=10)
    axes[0].set_ylabel("GiB per device")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("LLaMA-2-7B per-device memory vs dp, deviceless H100 (bf16 params, fp32 grads, fp32 Adam)")
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(out, dpi=120)


def start() -> None:
    """JAX on 8 simulated CPU devices (and deviceless GPUs), even on a GPU host, unless JAX_PLATFORMS says
    otherwise; the platform goes through jax.config, as JAX read the variable when it was imported."""
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    start_jax(host_devices=8)


def main() -> int:
    start()
    if "--replot" in sys.argv:  # tables and plot again from result.json, no compiling
        result = json.loads((HERE / "result.json").read_text())
    else:
        t0 = time.perf_counter()
        result = {"llama7b_vs_dp": vs_dp(), "llama3_405b": llama3_405b(), "seed_savings": seed_savings(),
                  "seed_scaling": seed_scaling()}  # fmt: skip
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        (HERE / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (HERE / "tables.md").write_text(tables(result))
    plot(result, HERE / "memory_vs_dp.png")
    print(tables(result))
    print(f"wrote result.json, tables.md, memory_vs_dp.png (compiling took {result['wall_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
