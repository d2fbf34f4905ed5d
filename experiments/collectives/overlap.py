"""How much DP communication does each ZeRO stage leave exposed, with Megatron's overlap off and on?

    python experiments/collectives/overlap.py [--paths spec,flat] [--setups 7b-m1,7b-m8,70b,70b-m8] [--out overlap]

Compiles (runs nothing) the train step of every strategy, deviceless for H100 pods, once with
`zero.overlap_grad_reduce: false` (the step as before overlap: grads reduced after the whole
backward, params gathered after the optimizer) and once with the defaults (per-unit reductions
inside the backward, params gathered inside the next forward), and reads from each program, as
`jzero hlo` does: the DP wire bytes per step, the part with no dot or convolution in its window
(exposed), its time on the pod's links against the step's compute at peak
(`jzero/inspect/timing.py`), the compiled temp peak, the device's peak (arguments + outputs -
aliased + temp, as `jzero memory` reads it: with `overlap_param_gather` the params rest sharded, so
what the arguments no longer hold, the gathered params, is temp) and the compile time. Setups: LLaMA-2-7B on
8 H100s (one host) and LLaMA-2-70B on 64 H100s (8 hosts, tp 8 in a host), each at 1 and 8 micro-batches;
`7b-hsdp`, `7b-hsdp-m8` and `7b-8l-hsdp` (not by default): LLaMA-2-7B at 1 and 8 micro-batches, and cut
to 8 layers so that DDP fits too, on 2 hosts x 8 H100s under HSDP (dp_outer 2 x dp 8; `--out
overlap_hsdp` for the README's HSDP table). Writes `<out>.json` (one `jzero hlo --json` document per setup, path
and overlap) and `<out>.md` (the tables of experiments/collectives/README.md; `--out overlap` by
default). About 13 minutes on 2 CPU cores for both paths and the default setups; needs `.[gpu-aot]`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from jzero.config import load_config
from jzero.errors import ConfigError
from jzero.inspect import comms
from jzero.inspect.compile import compile_step, with_zero
from jzero.inspect.memory import compiled_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ROOT, start  # noqa: E402  (this folder's script: JAX on CPU, deviceless GPUs)

HERE = Path(__file__).resolve().parent
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
LABELS = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}
LLAMA7 = str(ROOT / "configs" / "llama2_7b.yaml")
LLAMA70 = str(ROOT / "configs" / "llama2_70b.yaml")
SETUPS = {  # key: (label, config, overrides, topology)
    "7b-m1": ("LLaMA-2-7B, 8 H100, M=1", LLAMA7, [], "1 x 1 x 8"),
    "7b-m8": ("LLaMA-2-7B, 8 H100, M=8", LLAMA7, ["train.microbatches=8", "train.global_batch=64"], "1 x 1 x 8"),
    "70b": ("LLaMA-2-70B, 64 H100, M=1", LLAMA70, [], "8 x 1 x 8"),
    "70b-m8": ("LLaMA-2-70B, 64 H100, M=8", LLAMA70, ["train.microbatches=8", "train.global_batch=64"], "8 x 1 x 8"),
    "7b-hsdp": ("LLaMA-2-7B, HSDP 2 x 8 H100, M=1", LLAMA7, ["mesh.dp_outer=2", "train.global_batch=16"], "2 x 1 x 8"),
    "7b-hsdp-m8": ("LLaMA-2-7B, HSDP 2 x 8 H100, M=8", LLAMA7,
                   ["mesh.dp_outer=2", "train.microbatches=8", "train.global_batch=128"], "2 x 1 x 8"),
    "7b-8l-hsdp": ("LLaMA-2-7B, 8 layers, HSDP 2 x 8 H100, M=1", LLAMA7,
                   ["model.n_layers=8", "mesh.dp_outer=2", "train.global_batch=16"], "2 x 1 x 8"),
    "tiny": ("tiny GPT, 8 H100, M=2", None, ["train.microbatches=2"], "1 x 1 x 8"),  # a quick try, not default
}
DEFAULT_SETUPS = "7b-m1,7b-m8,70b,70b-m8"
OFF = ["zero.overlap_grad_reduce=false"]


def run(config, overrides, path, topology, overlap: bool) -> dict:
    cfg = load_config(config, [*overrides, *([] if overlap else OFF)])
    compiled = {}
    for s in STRATEGIES:
        compiled[s] = compile_step(with_zero(cfg, s, path), "h100", topology)
        print(f"  {s} overlap={'on' if overlap else 'off'}: {compiled[s].compile_s:.0f} s", flush=True)
    report = comms.report(compiled)
    for s, c in compiled.items():  # the device's peak: the state (arguments) and temp, as `jzero memory` reads it
        report["strategies"][s]["device_peak_bytes"] = compiled_bytes(c)["peak"]
    return report


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def row(label: str, path: str, s: str, off: dict, on: dict) -> str:
    def cells(d: dict) -> tuple[str, str, str]:
        sch, t = d["schedule"], d["schedule"]["timing"]
        exposed, dp = sch["exposed_dp_wire_bytes_per_step"], d["per_step"]["dp_wire_bytes"]
        return (f"{gib(exposed)} ({exposed / dp:.1%})" if dp else "0", f"{1e3 * t['exposed_s']:.0f}",
                gib(d["peak"]["temp_bytes"]), gib(d["device_peak_bytes"]))  # fmt: skip

    (e0, ms0, p0, q0), (e1, ms1, p1, q1) = cells(off) if off else ("cannot build", "-", "-", "-"), cells(on)
    t, c0 = on["schedule"]["timing"], f"{off['compile_s']:.0f}" if off else "-"
    return (
        f"| {label}, {path} | {LABELS[s]} | {gib(on['per_step']['dp_wire_bytes'])} | {on['ratio']:.3f} | {e0} | {e1} "
        f"| {ms0} -> {ms1} of {1e3 * t['wire_s']:.0f} | {1e3 * t['compute_s']:.0f} | {p0} -> {p1} | {q0} -> {q1} "
        f"| {c0} / {on['compile_s']:.0f} |"
    )


HEADER = (
    "| setup, path | stage | DP wire/step GiB | wire/theory | exposed GiB, overlap off | exposed GiB, on "
    "| exposed ms off -> on of all DP ms | compute ms (peak) | temp peak GiB off -> on "
    "| device peak GiB off -> on | compile s off / on |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default="spec", help="comma-separated zero.path values (default spec)")
    p.add_argument("--setups", default=DEFAULT_SETUPS, help=f"comma-separated, of {','.join(SETUPS)}")
    p.add_argument("--out", default="overlap", help="file name (no suffix) of the .json and .md written here")
    args = p.parse_args()
    if Path(args.out).name != args.out or not args.out:
        p.error(f"--out {args.out!r}: a file name, written in {HERE}")
    start()
    results, lines = {}, [HEADER]
    for key in args.setups.split(","):
        label, config, overrides, topology = SETUPS[key]
        for path in args.paths.split(","):
            t0 = time.perf_counter()
            print(f"### {label}, {path}", flush=True)
            try:  # the flat path without overlap is one whole-model buffer: a scanned stack may not fit a bucket
                off = run(config, overrides, path, topology, overlap=False)
            except ConfigError as e:
                print(f"  overlap off: {e}", flush=True)
                off = {"error": str(e)}
            on = run(config, overrides, path, topology, overlap=True)
            results[f"{label}, {path}"] = {"off": off, "on": on}
            for s in STRATEGIES:
                lines.append(row(label, path, s, off.get("strategies", {}).get(s), on["strategies"][s]))
                print(lines[-1], flush=True)
            print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
    (HERE / f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    (HERE / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {HERE / args.out}.json, {args.out}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
