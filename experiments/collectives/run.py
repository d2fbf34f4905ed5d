"""Which collectives does each ZeRO stage compile to, how many bytes, over which axes?

    python experiments/collectives/run.py

Compiles (runs nothing) the train step of every strategy, as `jzero hlo` does, for:
the default tiny GPT on 8 CPU devices (spec and flat paths) and on 8 deviceless H100s
(spec and flat), and LLaMA-2-7B on 8 and 64 deviceless H100s (spec path). Writes
`result.json` (one `jzero hlo --json` document per setup), `tables.txt` (the printed
tables) and `wire_bytes.png`. About 8 minutes on 2 CPU cores; needs `.[experiments,gpu-aot]`.
"""

import json
import os
import sys
import time
from pathlib import Path

import jax

from jzero.config import load_config
from jzero.inspect import comms
from jzero.inspect.compile import compile_step, with_zero
from jzero.runtime import start_jax

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STRATEGIES = ("no_shard", "optim", "optim_grads")
LLAMA = str(ROOT / "configs" / "llama2_7b.yaml")
SETUPS = {  # name: (config, overrides, path, target, topology)
    "tiny GPT, 8 CPU, spec": (None, [], "spec", "cpu", None),
    "tiny GPT, 8 CPU, flat": (None, [], "flat", "cpu", None),
    "tiny GPT, 8 H100, spec": (None, [], "spec", "h100", "1 x 1 x 8"),
    "tiny GPT, 8 H100, flat": (None, [], "flat", "h100", "1 x 1 x 8"),
    "LLaMA-2-7B, 8 H100, spec": (LLAMA, [], "spec", "h100", "1 x 1 x 8"),
    "LLaMA-2-7B, 64 H100, spec": (LLAMA, ["mesh.dp=64", "train.global_batch=64"], "spec", "h100", "8 x 1 x 8"),
}


def run_setup(config, overrides, path, target, topology) -> dict:
    cfg = load_config(config, overrides)
    compiled = {s: compile_step(with_zero(cfg, s, path), target, topology) for s in STRATEGIES}
    return comms.report(compiled)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"all-reduce": "#4c72b0", "reduce-scatter": "#dd8452", "all-gather": "#55a868"}
    groups = [[n for n in results if n.startswith("tiny")], [n for n in results if n.startswith("LLaMA")]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    for ax, names, (unit, scale) in zip(axes, groups, [("MiB", 2**20), ("GiB", 2**30)]):
        width, top = 0.26, 0.0
        for g, name in enumerate(names):
            for i, s in enumerate(STRATEGIES):
                doc = results[name]["strategies"][s]
                x, bottom = g + (i - 1) * width, 0.0
                for kind, color in colors.items():
                    v = doc["dp_wire_bytes_by_kind"].get(kind, 0.0) / scale
                    ax.bar(x, v, width * 0.9, bottom=bottom, color=color, label=kind if (g, i) == (0, 0) else None)
                    bottom += v
                theory = doc["theory"]["wire_bytes"] / scale
                ax.plot(
                    [x - width * 0.45, x + width * 0.45],
                    [theory] * 2,
                    color="black",
                    lw=2,
                    label="theory" if (g, i) == (0, 0) else None,
                )
                ax.text(x, max(bottom, theory), comms.LABELS[s], ha="center", va="bottom", fontsize=7)
                top = max(top, bottom, theory)
        ax.set_xticks(range(len(names)), [n.split(", ", 1)[1] for n in names], fontsize=8)
        ax.set_ylabel(f"data-parallel wire bytes per device per step ({unit})")
        ax.set_title(names[0].split(",")[0])
        ax.set_ylim(0, 1.25 * top)
        ax.legend(fontsize=7, loc="upper center", ncol=4)
    fig.suptitle("Compiled collectives per ZeRO stage (ring bytes; black: theory, docs/megatron.md)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def start() -> None:
    """JAX on 8 simulated CPU devices (and deviceless GPUs), even on a GPU host, unless JAX_PLATFORMS says
    otherwise; the platform goes through jax.config, as JAX read the variable when it was imported."""
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    start_jax(host_devices=8)


def main() -> int:
    start()
    results, tables = {}, []
    for name, setup in SETUPS.items():
        t0 = time.perf_counter()
        results[name] = run_setup(*setup)
        table = comms.format_report(results[name])
        tables.append(f"### {name}\n\n{table}\n")
        print(f"### {name} ({time.perf_counter() - t0:.0f} s)\n{table}\n", flush=True)
    (HERE / "result.json").write_text(json.dumps(results, indent=1) + "\n")
    (HERE / "tables.txt").write_text("\n".join(tables))
    plot(results, HERE / "wire_bytes.png")
    print(f"wrote {HERE / 'result.json'}, tables.txt, wire_bytes.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
