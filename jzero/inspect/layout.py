"""`jzero layout`: Megatron's flat buffers for a config, and which rank owns which part of which param.

The buffers come per group (`jzero.zero.flat.plan`): each FSDP unit's (a transformer block; a scanned
stack's is laid out per layer, the same in every layer) and the rest (embeddings, final norm, head), or
one group of every param without units (`zero.overlap_grad_reduce: false` below ZeRO-3). Each group's
buffer is Megatron's layout of its params.

A MoE model has two buffers per group with experts (docs/megatron.md, "The flat buffer"): the dense
one, sharded over the dense DP domain, and the expert one (this ep rank's experts), sharded over the
expert DP domain. A device's rank differs between them: dense rank r (over dp_outer x dp x ep, ep
innermost) is expert-DP rank r // ep (over dp_outer x dp) and holds the experts of ep rank r % ep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jzero.errors import ConfigError
from jzero.mesh import AUTO_DP

if TYPE_CHECKING:  # JAX is imported where the layout is read: `check_config_rank` runs before JAX starts
    from jzero.config_schema import Config
    from jzero.zero.flat.plan import FlatBuffer, FlatGroup, FlatPlan


def check_rank(rank: int, dp_size: int | None) -> None:
    """`jzero layout --rank`: a rank of the dense data-parallel group of `dp_size` ranks (the flat path's
    first dense buffer's, or the owned path's dense domain's), else one ConfigError line. `dp_size` None:
    not known yet; only a negative rank is refused."""
    if dp_size is None:
        if rank < 0:
            raise ConfigError(f"--rank {rank} must be >= 0 (a data-parallel rank)")
    elif not 0 <= rank < dp_size:
        raise ConfigError(f"--rank {rank} is outside the data-parallel group of size {dp_size}")


def check_config_rank(rank: int, cfg: Config) -> None:
    """Before JAX starts: `rank` is below the config's dense DP size, dp_outer x dp x ep (each path's group
    holds at most these ranks: fewer under HSDP or no_shard, checked with `check_rank` once the layout is
    built); with `mesh.dp: -1` the size waits for the devices, and only the sign is checked here."""
    check_rank(rank, None if cfg.mesh.dp == AUTO_DP else cfg.dp_domain_size)


def describe(fp: FlatPlan) -> dict:
    """The layout as plain data: {"groups": [describe_group, ...]} in plan order; and at the top level,
    the first group's first (dense) buffer as `describe_buffer` gives it, with its expert buffer under
    "expert" (the whole model's, without units)."""
    groups = [describe_group(fp, g) for g in fp.groups]
    first = groups[0]
    out = dict(first["buffers"][0])
    for buf in first["buffers"][1:]:
        out[buf["buffer"]["kind"]] = buf
    return out | {"groups": groups}


def describe_group(fp: FlatPlan, group: FlatGroup) -> dict:
    """One group: {"unit": its unit key, or None for the params in no unit; "layers": L of a scanned stack
    (its buffers' layout is one layer's) or None; "buffers": [describe_buffer, ...], dense first}."""
    from jzero.zero.flat.plan import REST

    return {
        "unit": None if group.key == REST else group.key,
        "layers": group.layers,
        "buffers": [describe_buffer(fp, buf) for buf in group.buffers],
    }


def describe_buffer(fp: FlatPlan, buf: FlatBuffer) -> dict:
    """One buffer: its dtype, kind and DP domain, buckets with padding, per-rank ownership (four
    Ranges; ranks in the buffer's own DP domain)."""
    import jax

    lay = buf.layout
    mesh = fp.plan.mesh
    tensors = jax.tree.leaves(fp.plan.tensors)
    params = [
        {
            "name": tensors[i].name,
            "local_shape": list(fp.layer_shape(i)),
            "numel": int(end - start),
            "start": start,
            "end": end,
            "bucket": b,
        }
        for i, (start, end, b) in zip(buf.params, lay.param_index_map)
    ]
    buckets = [
        {
            "id": b,
            "start": start,
            "end": end,
            "numel": end - start,
            "padding": end - start - sum(params[j]["numel"] for j in lay.bucket_params[b]),
            "shard_size": lay.shard_size(b),
        }
        for b, (start, end) in enumerate(lay.bucket_indices)
    ]
    ranks = []
    for r in range(lay.dp_size):
        owned = []
        for b, per_param in enumerate(lay.owned(r)):
            for j, rg in sorted(per_param.items(), key=lambda kv: kv[1]["gbuf_world"].start):
                owned.append({"bucket": b, "name": params[j]["name"]} | {k: [v.start, v.end] for k, v in rg.items()})
        ranks.append({"rank": r, "owned_numel": lay.owned_numel(r), "owned": owned})
    buffer = {
        "dtype": str(tensors[buf.params[0]].dtype),
        "kind": buf.kind,
        "dp_size": lay.dp_size,
        "tp_size": mesh.shape["tp"],
        "numel": lay.numel,
        "params": len(params),
        "shard_axes": list(buf.shard_axes),  # ranks are numbered over these, the first major
        "shard_axis_sizes": [mesh.shape[a] for a in buf.shard_axes],
    }
    if buf.kind != "dense":
        buffer |= {"dp_axes": list(buf.dp_axes), "ep_size": mesh.shape["ep"]}
    return {"buffer": buffer, "params": params, "buckets": buckets, "ranks": ranks}


def format_layout(d: dict, rank: int) -> str:
    """Every group's buffers of `describe` as text, with what dense-DP rank `rank` owns in each."""
    lines = []
    for g in d["groups"]:
        if len(d["groups"]) > 1:
            what = "params in no unit" if g["unit"] is None else f"FSDP unit {g['unit']}"
            stacked = f", a scanned stack of {g['layers']} layers laid out alike (one layer's below)"
            lines.append(f"group: {what}{stacked if g['layers'] else ''}")
        dense = next((b for b in g["buffers"] if b["buffer"]["kind"] == "dense"), None)
        for buf in g["buffers"]:
            if buf["buffer"]["kind"] == "dense":
                lines += _format_buffer(buf, rank)
            else:
                who = f" (dense rank {rank}; its ep rank's experts)"
                lines += _format_buffer(buf, _expert_rank(dense or d, buf, rank), who)
    return "\n".join(lines)


def _expert_rank(dense: dict, expert: dict, rank: int) -> int:
    """The expert-buffer rank of the device that is rank `rank` of the dense buffer: its coordinates
    on the dense shard axes, read on the expert shard axes (r // ep without HSDP; 0 under no_shard)."""
    dense, expert = dense["buffer"], expert["buffer"]
    if expert["dp_size"] == 1:
        return 0
    coords = dict(zip(dense["shard_axes"], np.unravel_index(rank, dense["shard_axis_sizes"])))
    return int(np.ravel_multi_index([coords[a] for a in expert["shard_axes"]], expert["shard_axis_sizes"]))


def _format_buffer(d: dict, rank: int, who: str = "") -> list[str]:
    buf = d["buffer"]
    over = f"dp={buf['dp_size']}" + (f" ({' x '.join(buf['shard_axes'])})" if buf["dp_size"] > 1 else "")
    if buf["kind"] == "dense":
        where = f"tp-local of tp={buf['tp_size']}"
    else:
        where = f"ep- and tp-local of ep={buf['ep_size']}, tp={buf['tp_size']}"
    lines = [
        f"buffer: {buf['kind']} {buf['dtype']}, {buf['params']} params, {buf['numel']} elements (padded, {where}), "
        f"sharded over {over}, {len(d['buckets'])} bucket(s)",
    ]
    for b in d["buckets"]:
        lines.append(
            f"  bucket {b['id']}: [{b['start']}, {b['end']}) {b['numel']} elements, padding {b['padding']}, "
            f"{b['shard_size']} per rank"
        )
    check_rank(rank, len(d["ranks"]))  # a negative one would index from the end
    r = d["ranks"][rank]
    lines.append(f"rank {rank}{who} owns {r['owned_numel']} param elements:")
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
    return lines
