"""Muon under ZeRO: what each layout moves over the DP wire, where its collectives sit, what it stores.

    python experiments/owned/run.py [--dp 8]

On `dp` simulated CPU devices, compiles one training step of each layout with Muon and reads the compiled
program (`jzero.inspect.overlap.read_schedule`, a loop's collectives times its trip count): the DP wire
bytes per device per step (ring accounting) in units of the fp32 param bytes P, their ratio to DDP's, the
collectives per step that are not scalars and how many of them are all-reduces (the spec layout's
Newton-Schulz on DP-sharded matrices all-reduces inside the update), and the fp32 main params + optimizer
state per device against total / dp. Two models:

  residual:  8 residual blocks of [512, 2048] and [2048, 512] matrices (16.8M params), optax.contrib.muon
  gpt:       jzero's GPT with its blocks scanned ([L, ...] stacks, owned by layer), 8 layers, d_model 256,
             Megatron's Muon (`jzero.zero.groups.muon`: Muon on the blocks' matrices, attention's too, AdamW on
             the rest)

Writes experiments/owned/result.json and prints a table.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jzero.inspect.overlap import read_schedule  # noqa: E402
from jzero.mesh import MeshConfig, make_mesh  # noqa: E402
from jzero.zero import ZeroConfig, build_zero  # noqa: E402
from jzero.zero.memory import shard_bytes  # noqa: E402

HERE = Path(__file__).resolve().parent
LAYOUTS = [
    ("spec", "no_shard"),
    ("spec", "optim"),
    ("spec", "optim_grads"),
    ("owned", "optim"),
    ("owned", "optim_grads"),
]


def residual():
    blocks, d, f = 8, 512, 2048
    params = {
        f"block{i}": {"w1": jax.ShapeDtypeStruct((d, f), jnp.float32), "w2": jax.ShapeDtypeStruct((f, d), jnp.float32)}
        for i in range(blocks)
    }

    def loss(params, batch):
        h = batch["x"]
        for i in range(blocks):
            h = h + jnp.tanh(h @ params[f"block{i}"]["w1"]) @ params[f"block{i}"]["w2"]
        return jnp.mean((h - batch["y"]) ** 2)

    batch = {"x": jax.ShapeDtypeStruct((64, d), jnp.float32), "y": jax.ShapeDtypeStruct((64, d), jnp.float32)}
    return dict(
        loss=loss,
        params=params,
        specs=jax.tree.map(lambda _: P(), params),
        units=None,
        inner=lambda: optax.contrib.muon(1e-2),
        batch=batch,
    )


def gpt():
    from jzero.config import from_dict
    from jzero.train.model import GPTModel
    from jzero.zero import groups

    cfg = from_dict(
        {
            "model": dict(
                vocab_size=256,
                d_model=256,
                n_layers=8,
                n_heads=4,
                d_ff=1024,
                seq_len=64,
                scan_layers=True,
                tie_embeddings=False,
            )
        }
    )
    model = GPTModel(cfg.model)
    params = model.abstract_params()
    layer_dims = jax.tree.map(lambda p, n: len(p.shape) - n, params, model.layer_ndims(params))
    matrices = model.muon_matrices(params)  # Megatron's: attention's split qkv and [H, K, D] proj too
    batch = jax.ShapeDtypeStruct((32, 65), jnp.int32)
    return dict(
        loss=model.loss_and_metrics,
        params=params,
        specs=model.tp_specs(params),
        units=model.units(params),
        inner=lambda: groups.muon(1e-2, weight_decay=0.1, layer_dims=layer_dims, matrices=matrices),
        batch=batch,
        has_aux=True,
    )


def measure(m: dict, path: str, strategy: str, dp: int) -> dict:
    mesh = make_mesh(MeshConfig(dp=dp), jax.devices()[:dp])
    zero = build_zero(
        m["loss"],
        m["inner"](),
        mesh,
        m["params"],
        m["specs"],
        ZeroConfig(strategy, path),
        units=m["units"],
        has_aux=m.get("has_aux", False),
        clip_grad=1.0,
    )
    state = jax.eval_shape(
        lambda: zero.init_state(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m["params"]))
    )
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, zero.shardings)
    sched = read_schedule(zero.step.lower(state, m["batch"]).compile().as_text())  # a loop's x its trip count
    p_bytes = 4 * sum(x.size for x in jax.tree.leaves(m["params"]))
    big = [o for o in sched.overlaps if o.collective.payload_bytes > 8]
    opt = shard_bytes([x for x in jax.tree.leaves(state.opt_state) if x.ndim])  # scalars left out
    return {
        "path": path,
        "strategy": strategy,
        "wire_P": sum(o.collective.wire_bytes * o.runs for o in sched.overlaps) / p_bytes,
        "collectives": sum(o.runs for o in big),
        "all_reduces": sum(o.runs for o in big if o.collective.kind == "all-reduce"),
        "kinds": sorted({o.collective.kind for o in big}),
        "state_over_total_d": opt / (p_bytes * (opt_factor(m) / 4) / dp),
    }


def opt_factor(m: dict) -> float:
    """Bytes per param of the whole-model optimizer state (moments; fp32 params keep no main copy)."""
    state = jax.eval_shape(
        m["inner"]().init, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), m["params"])
    )
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim) / sum(
        x.size for x in jax.tree.leaves(m["params"])
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--models", default="residual,gpt")
    args = ap.parse_args()
    result = {"dp": args.dp, "jax": jax.__version__, "models": {}}
    for name in args.models.split(","):
        m = {"residual": residual, "gpt": gpt}[name]()
        rows = [measure(m, path, strategy, args.dp) for path, strategy in LAYOUTS]
        ddp = rows[0]["wire_P"]
        for r in rows:
            r["wire_vs_ddp"] = r["wire_P"] / ddp
        result["models"][name] = rows
        print(
            f"\n{name} (dp={args.dp}): layout, DP wire / P, / DDP, non-scalar collectives (all-reduces), "
            "state / (total/d)"
        )
        for r in rows:
            print(
                f"  {r['path']:5} {r['strategy']:11} {r['wire_P']:6.2f} {r['wire_vs_ddp']:6.2f} "
                f"{r['collectives']:4} ({r['all_reduces']}) {r['state_over_total_d']:6.3f}  {','.join(r['kinds'])}"
            )
        sys.stdout.flush()
    (HERE / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
