"""DP wire bytes per step against the theory, per ZeRO stage, with Megatron's overlap off and on.

    python experiments/collectives/ratios.py [--rows tiny,big]

Compiles (runs nothing) the train step of each row's strategies, on 8 simulated CPU devices or
deviceless for H100 pods, once with `zero.overlap_grad_reduce: false` and once with the defaults,
and prints the markdown table of docs/inspect.md ("Measured/theory per step"): measured/theory of
the DP wire bytes per step (`jzero hlo`'s `ratio`), one value where overlap off and on agree, else
`off / on`. `tiny`: the tiny GPT of tests/inspect/test_fsdp_inspect.py (3 scanned blocks, no bias
unless the row says so, fp32 unless bf16; about 6 minutes on 2 CPU cores); `big`: LLaMA-2-7B,
LLaMA-3.1-405B's and Mixtral-8x7B's shapes on H100 pods (about 10 minutes). Needs `.[gpu-aot]`.
"""

import argparse
import sys
from pathlib import Path

from jzero.config import load_config
from jzero.inspect import comms
from jzero.inspect.compile import compile_step, with_zero

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ROOT, start  # noqa: E402  (this folder's script: JAX on CPU, deviceless GPUs)

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
TINY = [  # tests/helpers' tiny GPT (vocab 257 divides no mesh), 3 scanned blocks
    "model.vocab_size=257", "model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.d_ff=128",
    "model.seq_len=16", "model.tie_embeddings=false", "model.scan_layers=true", "model.bias=false",
    "train.global_batch=16", "data.kind=synthetic", "mesh.dp=8",
]  # fmt: skip
BF16 = ["precision.param_dtype=bfloat16"]
HSDP = ["mesh.dp_outer=2", "mesh.dp=4"]
MOE = ["mesh.dp=2", "mesh.ep=2", "mesh.tp=2", "model.moe.num_experts=4", "model.moe.top_k=2"]
LLAMA7 = str(ROOT / "configs" / "llama2_7b.yaml")
ROWS = {  # key: [(label, target, config, overrides, topology, strategies)]
    "tiny": [
        ("tiny GPT, 3 scanned blocks, no bias, fp32, dp=8", "cpu", None, TINY, None, STRATEGIES),
        ("the same, bf16 params", "h100", None, TINY + BF16, None, STRATEGIES),
        ("the same, with biases", "cpu", None, TINY + ["model.bias=true"], None, STRATEGIES),
        ("the same, 2 micro-batches", "cpu", None, TINY + ["train.microbatches=2"], None, STRATEGIES),
        ("the same, 2 micro-batches, bf16 params", "h100", None, TINY + BF16 + ["train.microbatches=2"], None,
         STRATEGIES),
        ("HSDP dp_outer 2 x dp 4, `outer_strategy: no_shard`", "cpu", None, TINY + HSDP, None, STRATEGIES),
        ("the same, bf16 params", "h100", None, TINY + HSDP + BF16, None, STRATEGIES),
        ("HSDP, `outer_strategy: optim`", "cpu", None, TINY + HSDP + ["zero.outer_strategy=optim"], None,
         STRATEGIES[1:]),
        ("the same, bf16 params", "h100", None, TINY + HSDP + BF16 + ["zero.outer_strategy=optim"], None,
         STRATEGIES[1:]),
        ("dp 4 x tp 2, with biases", "cpu", None, TINY + ["model.bias=true", "mesh.dp=4", "mesh.tp=2"], None,
         STRATEGIES),
        ("MoE, dp 2 x ep 2 x tp 2, bf16 params", "h100", None, TINY + MOE + BF16, None, STRATEGIES),
    ],  # fmt: skip
    "big": [
        ("LLaMA-2-7B, dp=8", "h100", LLAMA7, [], "1 x 1 x 8", STRATEGIES),
        ("LLaMA-2-7B, dp=64", "h100", LLAMA7, ["mesh.dp=64", "train.global_batch=64"], "8 x 1 x 8", STRATEGIES[2:]),
        ("LLaMA-2-7B, 8 micro-batches, dp=8", "h100", LLAMA7, ["train.microbatches=8", "train.global_batch=64"],
         "1 x 1 x 8", STRATEGIES[2:3]),
        ("LLaMA-2-7B, HSDP dp_outer 2 x dp 8, `no_shard`", "h100", LLAMA7,
         ["mesh.dp_outer=2", "train.global_batch=16"], "2 x 1 x 8",
         STRATEGIES[2:]),
        ("LLaMA-2-7B, HSDP dp_outer 2 x dp 8, `optim`", "h100", LLAMA7,
         ["mesh.dp_outer=2", "train.global_batch=16", "zero.outer_strategy=optim"], "2 x 1 x 8", STRATEGIES[2:]),
        ("LLaMA-3.1-405B shape, tp 8 x dp 128 (1024 GPUs)", "h100", str(ROOT / "configs" / "llama3_405b.yaml"), [],
         "1 x 128 x 8", STRATEGIES[3:]),
        ("Mixtral-8x7B shape, dp 8 x ep 8", "h100", str(ROOT / "configs" / "mixtral_8x7b.yaml"), [], "8 x 1 x 8",
         STRATEGIES[2:3]),
    ],  # fmt: skip
}
OFF = ["zero.overlap_grad_reduce=false"]


def ratios(target, config, overrides, topology, strategies, overlap: bool) -> dict[str, float]:
    cfg = load_config(config, [*overrides, *([] if overlap else OFF)])
    return {s: comms.analyze(compile_step(with_zero(cfg, s, "spec"), target, topology))["ratio"] for s in strategies}


def cell(off: float | None, on: float | None) -> str:
    """One value where overlap off and on read the same to 3 decimals, else `off / on`; empty if not run."""
    if on is None:
        return ""
    return f"{on:.3f}" if f"{off:.3f}" == f"{on:.3f}" else f"{off:.3f} / {on:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="tiny,big", help="comma-separated: " + ",".join(ROWS))
    args = ap.parse_args()
    start()
    print("| program (spec path) | target | DDP | ZeRO-1 | ZeRO-2 | ZeRO-3 |\n|---|---|---:|---:|---:|---:|")
    for key in args.rows.split(","):
        for label, target, config, overrides, topology, strategies in ROWS[key]:
            off, on = (ratios(target, config, overrides, topology, strategies, o) for o in (False, True))
            cells = [cell(off.get(s), on.get(s)) for s in STRATEGIES]
            print(f"| {label} | {'CPU' if target == 'cpu' else 'H100'} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
