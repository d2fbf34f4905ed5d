"""jzero's exports continued by real Megatron-Core (README.md). Two steps, two Python environments:

    python experiments/megatron_roundtrip/run.py export OUT          # jzero's side (this repo's env)
    $MEGATRON_PY experiments/megatron_roundtrip/megatron_side.py OUT  # torch + megatron-core 0.16.1
    python experiments/megatron_roundtrip/run.py compare OUT         # -> result.json, the table

`export`, for each fixture variant of tests/data/megatron: (a) Megatron's step-10 checkpoint loaded
into jzero (flat ZeRO-2 on dp 8, not Megatron's ZeRO-1 on dp 4) and exported; (b) jzero's own 10
steps from Megatron's init, exported, and jzero's steps 11..15 after them (`OUT/<variant>/b_jzero.json`).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
import numpy as np  # noqa: E402

from helpers.megatron_fixtures import (  # noqa: E402
    HYPERPARAMS,
    NAMES,
    ORDER,
    VARIANTS,
    build,
    by_name,
    checkpoint,
    final_params,
    init_state,
    trace,
    train,
)  # fmt: skip
from jzero.interop import megatron  # noqa: E402


def export(out: Path) -> None:
    for variant, bucket_size in VARIANTS.items():
        zero = build(variant, "optim_grads", "flat", 8)
        state = megatron.load(checkpoint(variant, "legacy"), zero, NAMES, bucket_size=bucket_size)
        megatron.save(out / variant / "a", state, zero, NAMES, hyperparams=HYPERPARAMS, bucket_size=bucket_size,
                      order=ORDER)  # fmt: skip
        state, _, _ = train(zero, init_state(zero), 1, 10)
        megatron.save(out / variant / "b", state, zero, NAMES, hyperparams=HYPERPARAMS, bucket_size=bucket_size,
                      order=ORDER)  # fmt: skip
        state, losses, norms = train(zero, state, 11, 15)
        params = {k: v.tolist() for k, v in by_name(jax.device_get(zero.full_params(state.params))).items()}
        (out / variant / "b_jzero.json").write_text(json.dumps({"losses": losses.tolist(), "norms": norms.tolist(),
                                                                "params": params}))  # fmt: skip
        print(f"{variant}: exported {out / variant}/a and b")


def compare(out: Path) -> None:
    result = {}
    for variant in VARIANTS:
        a = json.loads((out / variant / "a_megatron.json").read_text())
        b = json.loads((out / variant / "b_megatron.json").read_text())
        j = json.loads((out / variant / "b_jzero.json").read_text())
        want, final = trace(variant, continued=True), final_params(variant, continued=True)
        result[variant] = {
            "a: Megatron continuing jzero's export of its own step-10 checkpoint, vs Megatron's own steps 11..15": {
                "losses_bitwise_equal": [t["loss"] for t in a["trace"]] == [t["loss_global_mean"] for t in want],
                "grad_norms_bitwise_equal": [t["grad_norm"] for t in a["trace"]] == [t["grad_norm"] for t in want],
                "max_abs_param_diff": max(float(np.abs(np.float32(a["params"][n]) - final[n]).max()) for n in ORDER),
                "adam_betas_eps_as_loaded": a["groups"],
            },
            "b: Megatron continuing jzero's own 10 steps, vs jzero continuing them": {
                "max_rel_loss_diff": max(abs(t["loss"] / x - 1) for t, x in zip(b["trace"], j["losses"])),
                "max_rel_grad_norm_diff": max(abs(t["grad_norm"] / x - 1) for t, x in zip(b["trace"], j["norms"])),
                "max_abs_param_diff": max(
                    float(np.abs(np.float32(b["params"][n]) - np.float32(j["params"][n])).max()) for n in ORDER
                ),
            },
        }
    (Path(__file__).parent / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    command, out = sys.argv[1], Path(sys.argv[2])
    {"export": export, "compare": compare}[command](out)
