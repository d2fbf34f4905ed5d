"""What do bf16 moments, a quantized param all-gather and fp16 cost in loss, and what do they save?

    python experiments/precision/run.py [--steps 200] [--bytes-only]

Trains the embedded default model (ZeRO-2 on the flat path, 8 simulated CPU devices, bf16 params)
once per variant below, each a `jzero train` with one change, and compiles each variant's step
for 8 H100s, deviceless (`jzero hlo` / `jzero memory --json`), for the bytes it moves and holds. Writes `result.json`,
`table.md` and `loss.png` beside this file.

The baseline's twin on the spec path differs from it only in the order of floating-point sums: the
gap between those two is the rounding noise a 200-step AdamW run amplifies (experiments/flat_vs_spec),
the yardstick for every other gap.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = ["precision.param_dtype=bfloat16", "zero.path=flat", "zero.strategy=optim_grads"]
VARIANTS = {  # name -> the --set overrides on top of BASE
    "baseline (bf16 params, fp32 moments, bf16 gather)": [],
    "baseline on the spec path (rounding noise)": ["zero.path=spec"],
    "bf16 moments": ["optimizer.moments_dtype=bfloat16"],
    "int8 param all-gather": ["zero.param_gather_dtype=int8"],
    "fp8 (e4m3) param all-gather": ["zero.param_gather_dtype=float8_e4m3fn"],
    "fp16 params, loss scaling from 2**32": ["precision.param_dtype=float16"],
}


def jzero(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "jzero.cli", *args], check=True, stdout=subprocess.DEVNULL)


def sets(overrides: list[str]) -> list[str]:
    return [a for kv in [*BASE, *overrides] for a in ("--set", kv)]


def train(overrides: list[str], steps: int, out: Path) -> tuple[list[dict], dict]:
    jzero("train", "--quiet", "--out", str(out), *sets([*overrides, f"train.steps={steps}"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "summary.json").read_text())


def compiled_bytes(overrides: list[str], tmp: Path) -> dict:
    """Per device: the optimizer moments' bytes (`jzero memory`) and the DP all-gather's wire bytes
    (`jzero hlo`; codes + scales for a quantized gather) of the ZeRO-2 step compiled for 8 H100s
    (deviceless): XLA:CPU widens a bf16 all-gather to f32 on the wire, XLA:GPU does not."""
    path = "spec" if "zero.path=spec" in overrides else "flat"
    common = ["--path", path, "--strategies", "optim_grads", "--target", "h100", *sets(overrides)]
    jzero("memory", "--json", str(tmp / "m.json"), *common)
    jzero("hlo", "--json", str(tmp / "h.json"), *common)
    memory = json.loads((tmp / "m.json").read_text())["strategies"]["optim_grads"]
    comms = json.loads((tmp / "h.json").read_text())["strategies"]["optim_grads"]
    gather = comms.get("param_gather")
    return {
        "optimizer_moments": memory["state"]["optimizer_moments"],
        "main_params": memory["state"]["main_params"],
        "param_all_gather_wire": gather["wire_bytes"] if gather else comms["dp_wire_bytes_by_kind"]["all-gather"],
    }


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--bytes-only", action="store_true", help="keep result.json's loss curves, recompile for the bytes")
    args = ap.parse_args()
    steps = args.steps
    if args.bytes_only:
        result = json.loads((HERE / "result.json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            for r in result["runs"].values():
                r["bytes_per_device"] = compiled_bytes(r["overrides"], Path(tmp))
        return write(result)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(VARIANTS.items()):
            rows, summary = train(overrides, steps, Path(tmp) / f"run{i}")
            runs[name] = {
                "overrides": overrides,
                "loss": [r["loss"] for r in rows],
                "val_loss": summary.get("val_loss_last"),
                "skipped_steps": sum(int(r.get("skipped", 0)) for r in rows),
                "mean_step_time_s": summary["mean_step_time_s"],
                "bytes_per_device": compiled_bytes(overrides, Path(tmp)),
            }
            print(name, json.dumps({k: v for k, v in runs[name].items() if k != "loss"}), flush=True)
    base = runs[next(iter(VARIANTS))]
    tail = max(1, steps // 4)  # the last quarter's mean loss: one step's loss is noisy
    for r in runs.values():
        r["final_loss_mean"] = mean(r["loss"][-tail:])
        r["gap_vs_baseline"] = r["final_loss_mean"] / base["final_loss_mean"] - 1
        r["val_gap_vs_baseline"] = None if r["val_loss"] is None else r["val_loss"] / base["val_loss"] - 1
    write({"steps": steps, "tail_steps": tail, "base_overrides": BASE, "runs": runs})


def write(result: dict) -> None:
    (HERE / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (HERE / "table.md").write_text(table(result))
    plot(result)
    print(table(result))


def table(result: dict) -> str:
    tail = result["tail_steps"]
    lines = [
        f"| variant | mean loss, last {tail} steps | vs baseline | val loss | vs baseline | skipped | "
        "moments / device | param all-gather / device / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["runs"].items():
        b = r["bytes_per_device"]
        val = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        vgap = "-" if r["val_gap_vs_baseline"] is None else f"{100 * r['val_gap_vs_baseline']:+.2f}%"
        lines.append(
            f"| {name} | {r['final_loss_mean']:.4f} | {100 * r['gap_vs_baseline']:+.2f}% | {val} | {vgap} | "
            f"{r['skipped_steps']} | {b['optimizer_moments'] / 2**10:.1f} KiB | "
            f"{b['param_all_gather_wire'] / 2**10:.1f} KiB |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    k = 10  # a moving average over k steps, for legibility
    for name, r in result["runs"].items():
        loss = r["loss"]
        smooth = [mean(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
        ax.plot(range(1, len(loss) + 1), smooth, label=name, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of the last {k} steps)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title("default model, ZeRO-2, 8 simulated devices")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "loss.png", dpi=110)


if __name__ == "__main__":
    main()
