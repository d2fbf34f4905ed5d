"""`jzero layout`: Megatron's flat buffers for a config, and which rank owns which part of which param."""

from __future__ import annotations

import jax

from jzero.zero.flat_plan import FlatPlan


def describe(fp: FlatPlan) -> dict:
    """The layout as plain data: buffer, buckets with padding, per-rank ownership (four Ranges)."""
    lay = fp.layout
    tensors = jax.tree.leaves(fp.plan.tensors)
    params = [
        {"name": t.name, "local_shape": list(shape), "numel": int(end - start), "start": start, "end": end, "bucket": b}
        for t, shape, (start, end, b) in zip(tensors, fp.local_shapes, lay.param_index_map)
    ]
    buckets = [
        {
            "id": b,
            "start": start,
            "end": end,
            "numel": end - start,
            "padding": end - start - sum(params[i]["numel"] for i in lay.bucket_params[b]),
            "shard_size": lay.shard_size(b),
        }
        for b, (start, end) in enumerate(lay.bucket_indices)
    ]
    ranks = []
    for r in range(lay.dp_size):
        owned = []
        for b, per_param in enumerate(lay.owned(r)):
            for i, rg in sorted(per_param.items(), key=lambda kv: kv[1]["gbuf_world"].start):
                owned.append({"bucket": b, "name": tensors[i].name} | {k: [v.start, v.end] for k, v in rg.items()})
        ranks.append({"rank": r, "owned_numel": lay.owned_numel(r), "owned": owned})
    return {
        "buffer": {
            "dtype": str(tensors[0].dtype),
            "kind": "dense",
            "dp_size": lay.dp_size,
            "tp_size": fp.plan.mesh.shape["tp"],
            "numel": lay.numel,
            "params": len(params),
        },
        "params": params,
        "buckets": buckets,
        "ranks": ranks,
    }


def format_layout(d: dict, rank: int) -> str:
    buf = d["buffer"]
    lines = [
        f"buffer: {buf['kind']} {buf['dtype']}, {buf['params']} params, {buf['numel']} elements (padded, tp-local of "
        f"tp={buf['tp_size']}), sharded over dp={buf['dp_size']}, {len(d['buckets'])} bucket(s)",
    ]
    for b in d["buckets"]:
        lines.append(
            f"  bucket {b['id']}: [{b['start']}, {b['end']}) {b['numel']} elements, padding {b['padding']}, "
            f"{b['shard_size']} per rank"
        )
    r = d["ranks"][rank]
    lines.append(f"rank {rank} owns {r['owned_numel']} param elements:")
    for o in r["owned"]:
        p0, p1 = o["param"]
        w0, w1 = o["gbuf_world"]
        l0, l1 = o["gbuf_local"]
        lines.append(
            f"  bucket {o['bucket']}  {o['name']:32} param [{p0}, {p1})  "
            f"gbuf_world [{w0}, {w1})  gbuf_local [{l0}, {l1})"
        )
    totals = ", ".join(f"{x['rank']}: {x['owned_numel']}" for x in d["ranks"])
    lines.append(f"owned elements per rank: {totals}")
    return "\n".join(lines)
