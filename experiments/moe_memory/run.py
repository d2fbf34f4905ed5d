"""Mixtral-8x7B on 64 H100s: per-device memory of each ZeRO stage, dense and expert domains apart.

    python experiments/moe_memory/run.py [--tables]

Compiles (runs nothing) the spec-path train step of `configs/mixtral_8x7b.yaml` for 64
deviceless H100s (8 hosts x 8), as `jzero memory` and `jzero hlo` do, for:

- ep 8 x dp 8 (the preset) and ep 4 x tp 2 x dp 8: DDP, ZeRO-1, ZeRO-2;
- ZeRO-2 with ep 4, 2, 1 (dp 16, 32, 64, tp 1): the expert-DP size against ep.

Micro-batch 1 x 4096 tokens per DP rank (global batch = dp x ep). Writes `result.json`
(per compile: `jzero memory`'s document, and `jzero hlo`'s collectives, theory and peak)
and `tables.md` (the README's tables, generated). About 6 minutes on 2 CPU cores; needs
`pip install -e .[gpu-aot]`. `--tables` rewrites `tables.md` from `result.json` without compiling.
"""

import json
import os
import sys
import time
from pathlib import Path

import jax

from jzero.config import load_config
from jzero.inspect import comms, memory
from jzero.inspect.compile import compile_step, with_zero
from jzero.inspect.targets import TARGETS
from jzero.runtime import start_jax

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parents[1] / "configs" / "mixtral_8x7b.yaml"
TOPOLOGY = "8 x 1 x 8"
H100 = TARGETS["h100"].memory_bytes
STRATEGIES = ("no_shard", "optim", "optim_grads")
LABEL = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2"}
# name: ((dp, ep, tp), strategies)
VARIANTS = {
    "ep8": ((8, 8, 1), STRATEGIES),
    "ep4_tp2": ((8, 4, 2), STRATEGIES),
    "ep4": ((16, 4, 1), ("optim_grads",)),
    "ep2": ((32, 2, 1), ("optim_grads",)),
    "ep1": ((64, 1, 1), ("optim_grads",)),
}


def compile_one(mesh: tuple[int, int, int], strategy: str) -> dict:
    """One deviceless compile: {"compile_s", "memory": memory.analyze, "hlo": comms.analyze, header}."""
    dp, ep, tp = mesh
    over = [f"mesh.dp={dp}", f"mesh.ep={ep}", f"mesh.tp={tp}", f"train.global_batch={dp * ep}"]
    cfg = with_zero(load_config(CONFIG, over), strategy)
    c = compile_step(cfg, "h100", TOPOLOGY)  # with XLA's dump: the peak's breakdown
    hlo = comms.analyze(c)
    hlo["schedule"].pop("collectives")  # per instruction; the totals stay
    head = comms.header(c)
    head.pop("config")
    return {"header": head, "compile_s": round(c.compile_s, 1), "memory": memory.analyze(c, H100), "hlo": hlo}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def tables(result: dict) -> str:
    runs = result["runs"]
    lines = ["### Per-device memory by strategy (GiB), 64 H100s, micro-batch 1 x 4096 tokens per DP rank\n",
             "state: read from the compiled step's shardings; formula: Megatron's, dense over d, experts over "
             "edp; **bold**: does not fit an 80 GB H100 (79.1 GiB).\n",
             "| mesh | stage | params | main params | Adam | grads | state | formula | of it dense / expert "
             "| temp | peak | compile (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        m, h = r["memory"], r["header"]
        st, fd, cb = m["state"], m["formula_domains"], m["compiled"]
        peak = gib(cb["peak"]) if m["fits"] else f"**{gib(cb['peak'])}**"
        mesh = f"dp {h['mesh']['dp']} x ep {h['mesh']['ep']} x tp {h['mesh']['tp']} (d {h['d']}, edp {h['edp']})"
        lines.append(
            f"| {mesh} | {LABEL[name.split('/')[1]]} | {gib(st['params'])} | {gib(st['main_params'])} "
            f"| {gib(st['optimizer_moments'])} | {gib(st['grads'])} | {gib(st['total'])} "
            f"| {gib(m['formula']['total'])} | {gib(fd['dense']['total'])} / {gib(fd['expert']['total'])} "
            f"| {gib(cb['temp'])} | {peak} | {r['compile_s']:.0f} |"
        )
    lines += ["", "### What travels, per device per step (GiB), and what fills temp at the peak\n",
              "DP: ring bytes of the grad reduction and param gather over the dense (dp x ep) and expert (dp) "
              "domains, measured / theory; tokens: the MoE all-to-all over ep, 4 per block forward and "
              "backward + 2 recomputed, x 32 blocks.\n",
              "| mesh | stage | DP dense | DP expert | measured / theory | exposed DP | tokens all-to-all per step | "
              "temp at peak: local grads / reduced grads / activations / other |",
              "|---|---|---|---|---:|---:|---:|---|"]  # fmt: skip
    for name, r in runs.items():
        h, hl = r["header"], r["hlo"]
        dom, th = hl["dp_wire_bytes_by_domain"], hl["theory"]["domains"]
        mesh = f"dp {h['mesh']['dp']} x ep {h['mesh']['ep']} x tp {h['mesh']['tp']}"
        cells = [f"{gib(dom[d]) if d in dom else 'n/a'} / {gib(th[d]['wire_bytes'])}" for d in ("dense", "expert")]
        tok = hl["tokens"]
        tokens = "-"
        if tok is not None:  # measured (theory)
            tokens = f"{gib(tok['measured']['per_step_wire_bytes'])} ({gib(tok['per_step_wire_bytes'])})"
        cat = hl["peak"]["by_category"]
        other = sum(v for k, v in cat.items() if k not in ("local_grads", "reduced_grads", "activations"))
        lines.append(
            f"| {mesh} | {LABEL[name.split('/')[1]]} | {cells[0]} | {cells[1]} | {hl['ratio']:.3f} "
            f"| {gib(hl['schedule']['exposed_dp_wire_bytes'])} | {tokens} "
            f"| {gib(cat.get('local_grads', 0))} / {gib(cat.get('reduced_grads', 0))} / "
            f"{gib(cat.get('activations', 0))} / {gib(other)} |"
        )
    lines += ["", "### ZeRO-2 with tp 1: the expert-DP size against ep (ep x edp = 64)\n",
              "Expert domain per device: its params (bf16, replicated over edp) and its sharded state (fp32 "
              "main params, Adam moments, ZeRO-2 grads: 16 bytes per param / edp).\n",
              "| ep | edp | expert params per rank | expert params (GiB) | expert sharded state (GiB) "
              "| DP expert (GiB) | tokens all-to-all (GiB) | peak (GiB) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        if not name.endswith("/optim_grads") or r["header"]["mesh"]["tp"] != 1:
            continue
        h, m, hl = r["header"], r["memory"], r["hlo"]
        ex = m["formula_domains"]["expert"]
        tok = hl["tokens"]
        peak = gib(m["compiled"]["peak"]) if m["fits"] else f"**{gib(m['compiled']['peak'])}**"
        lines.append(
            f"| {h['mesh']['ep']} | {h['edp']} | {ex['numel'] / 1e9:.2f}B | {gib(ex['params'])} "
            f"| {gib(ex['total'] - ex['params'])} | {gib(hl['theory']['domains']['expert']['wire_bytes'])} "
            f"| {'-' if tok is None else gib(tok['per_step_wire_bytes'])} | {peak} |"
        )
    return "\n".join(lines) + "\n"


def start() -> None:
    """JAX on 8 simulated CPU devices (and deviceless GPUs), even on a GPU host, unless JAX_PLATFORMS says
    otherwise; the platform goes through jax.config, as JAX read the variable when it was imported."""
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    start_jax(host_devices=8)


def main() -> int:
    start()
    if "--tables" in sys.argv:
        result = json.loads((HERE / "result.json").read_text())
    else:
        t0 = time.perf_counter()
        runs = {}
        for name, (mesh, strategies) in VARIANTS.items():
            for s in strategies:
                r = runs[f"{name}/{s}"] = compile_one(mesh, s)
                print(
                    f"{name} {s}: state {gib(r['memory']['state']['total'])} GiB, peak "
                    f"{gib(r['memory']['compiled']['peak'])} GiB, compiled in {r['compile_s']:.0f} s",
                    flush=True,
                )
        result = {"config": "configs/mixtral_8x7b.yaml", "target": "h100", "topology": TOPOLOGY,
                  "memory_bytes": H100, "jax": jax.__version__, "runs": runs,
                  "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        (HERE / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (HERE / "tables.md").write_text(tables(result))
    print(tables(result))
    wrote = "tables.md" if "--tables" in sys.argv else "result.json, tables.md"
    print(f"wrote {wrote} ({result['wall_s']:.0f} s compiling and reading)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
