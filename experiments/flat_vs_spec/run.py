"""Does the flat path train the default model to the same loss curve as the spec path?

    python experiments/flat_vs_spec/run.py [--steps 200]

Runs `jzero train` (the embedded default, ZeRO-2) once per path and writes
`experiments/flat_vs_spec/result.json`: both loss curves, the largest relative loss
difference, and step times.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(path: str, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "jzero.cli", "train", "--quiet", "--out", str(out),
           "--set", f"zero.path={path}", "--set", f"train.steps={steps}"]
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    steps = ap.parse_args().steps
    with tempfile.TemporaryDirectory() as tmp:
        curves = {p: run(p, steps, Path(tmp) / p) for p in ("spec", "flat")}
    spec, flat = ([m["loss"] for m in curves[p]] for p in ("spec", "flat"))
    rel = [abs(a - b) / abs(a) for a, b in zip(spec, flat)]
    result = {
        "steps": steps,
        "max_rel_loss_diff": max(rel),
        "step_of_max": rel.index(max(rel)) + 1,
        "final_loss": {"spec": spec[-1], "flat": flat[-1]},
        "mean_step_time_s": {p: sum(m["step_time_s"] for m in c[1:]) / (len(c) - 1) for p, c in curves.items()},
        "loss": {"spec": spec, "flat": flat},
    }
    (HERE / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "loss"}, indent=1))


if __name__ == "__main__":
    main()
