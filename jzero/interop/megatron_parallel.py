"""Megatron's model-parallel pieces joined into one model (and a whole model split into them): the
tensor-, pipeline- and expert-parallel ranks of a GPTModel, as its checkpoints hold them.

Each model-parallel rank (tp, pp, ep) holds its local params under local names: its pipeline
stage's layers numbered from 0, its expert-parallel rank's experts numbered from 0
(`local_experts.<i>`), and each tensor-parallel param's slice. Megatron's partition rules
(`megatron/core/tensor_parallel/layers.py` and the GPT layer spec), by name:

  embedding.word_embeddings.weight, output_layer.weight   dim 0 (the padded vocabulary): vocab-parallel
  linear_qkv.weight, .bias                                dim 0: rank r holds query groups [r G/tp, (r+1) G/tp)
                                                          whole (each group's query heads, key, value rows)
  linear_fc1.weight, .bias                                dim 0; a gated MLP's (swiglu) [gate; up] halves
                                                          each split on its own: rank r holds [gate_r; up_r]
  linear_proj.weight, linear_fc2.weight                   dim 1 (row-parallel)
  everything else (norms, row-parallel biases,            replicated: each tp rank holds the whole tensor
    position embeddings, the MoE router)

A gated MLP is recognised by its shapes: its fc1 has twice the rows of its fc2's columns. `join`
concatenates the tp slices; `split` cuts a whole tensor into them (a torch_dist checkpoint holds
whole tensors but each (tp, pp) rank's optimizer buffer). The same rules apply to the fp32 main
params and Adam's moments. Expert params with tensor parallelism (expert-TP) are not handled.

`join_ranks` joins a checkpoint's ranks into the whole model (reading); `rank_names` and `split_ranks`
are its inverse, the whole model cut into each rank's local params (writing, and reading torch_dist's
per-rank buffers): pipeline stage p holds layers [p L/pp, (p+1) L/pp) numbered from 0, the first stage
what precedes the layers, the last what follows them; ep rank e the experts [e E/ep, (e+1) E/ep)
numbered from 0; a tied model under pipeline parallelism keeps a copy of the embedding on its last
stage (`output_layer.weight`). `mp_folder` names a rank's legacy folder.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from jzero.interop import InteropError
from jzero.interop.megatron_format import EXTRA_STATE

LAYER = re.compile(r"(.*?\bdecoder\.layers\.)(\d+)\.(.*)")
EXPERT = re.compile(r"(.*\.experts\.local_experts\.)(\d+)\.(.*)")
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # the optimizer's per-param state (fp32 main params, Adam)
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


def is_expert(name: str) -> bool:
    """Whether `name` is an expert param (Megatron's second buffer and optimizer, over expert-DP)."""
    return ".experts." in name


def tp_dim(name: str) -> int | None:
    """The dim Megatron splits `name` on over tensor parallelism, None if replicated (module docstring)."""
    if re.search(r"(^|\.)(word_embeddings\.weight|output_layer\.weight)$", name):
        return 0
    if re.search(r"\.(linear_qkv|linear_fc1)\.(weight|bias)$", name):
        return 0
    if re.search(r"\.(linear_proj|linear_fc2)\.weight$", name):
        return 1
    return None


def gated(shapes: dict[str, tuple]) -> set[str]:
    """The MLP modules (name prefixes before `linear_fc1`) among `shapes` (name -> local shape) whose fc1
    is gated (swiglu): fc1's rows are twice fc2's columns."""
    out = set()
    for name, shape in shapes.items():
        if name.endswith(".linear_fc1.weight"):
            module = name[: -len("linear_fc1.weight")]
            fc2 = shapes.get(module + "linear_fc2.weight")
            if fc2 is not None and len(fc2) == 2 and shape[0] == 2 * fc2[1]:
                out.add(module)
    return out


def _is_gated(name: str, glu: set[str]) -> bool:
    return bool(re.search(r"\.linear_fc1\.(weight|bias)$", name)) and name[: name.rindex("linear_fc1.")] in glu


def join(name: str, pieces: Sequence[np.ndarray], glu: set[str]) -> np.ndarray:
    """The whole tensor `name` from its tensor-parallel slices (rank order); replicated: rank 0's."""
    dim = tp_dim(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    if _is_gated(name, glu):
        halves = [np.split(p, 2, axis=0) for p in pieces]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
    return np.concatenate(pieces, axis=dim)


def split(name: str, whole: np.ndarray, tp: int, glu: set[str]) -> list[np.ndarray]:
    """`join`'s inverse: the `tp` slices of the whole tensor `name`."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return [whole] * tp
    if whole.shape[dim] % (2 * tp if _is_gated(name, glu) else tp):
        raise InteropError(f"{name} {tuple(whole.shape)} does not split over tensor parallelism {tp} on dim {dim}")
    if _is_gated(name, glu):
        gate, up = np.split(whole, 2, axis=0)
        return [np.concatenate([g, u], axis=0) for g, u in zip(np.split(gate, tp), np.split(up, tp))]
    return np.split(whole, tp, axis=dim)


@dataclasses.dataclass
class Rank:
    """One model-parallel rank's local params: `model` its weights in registration order (local names),
    `state` per STATE_KEYS the optimizer's arrays of the params it has state for (a dense param's
    state lives on ep rank 0 only in the legacy format)."""

    tp: int
    pp: int
    ep: int
    model: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]]


def global_names(ranks: dict[tuple[int, int, int], Rank]) -> dict[tuple[int, int, int], dict[str, str]]:
    """Per rank, local name -> global name: layers renumbered by the layers of the earlier stages, experts
    by the experts of the lower ep ranks (`local_experts.<ep * n + i>`)."""
    pps = sorted({k[1] for k in ranks})
    offsets, total = {}, 0
    for pp in pps:
        offsets[pp] = total
        first = ranks[0, pp, 0].model
        total += len({int(m[2]) for m in map(LAYER.fullmatch, first) if m})
    out = {}
    for key, r in ranks.items():
        per_layer: dict[int, set[int]] = {}
        for n in r.model:
            m, e = LAYER.fullmatch(n), EXPERT.fullmatch(n)
            if m and e:
                per_layer.setdefault(int(m[2]), set()).add(int(e[2]))
        names = {}
        for n in r.model:
            g = n
            e = EXPERT.fullmatch(g)
            if e:
                layer = LAYER.fullmatch(g)
                local = len(per_layer[int(layer[2])])
                g = f"{e[1]}{r.ep * local + int(e[2])}.{e[3]}"
            m = LAYER.fullmatch(g)
            if m:
                g = f"{m[1]}{offsets[r.pp] + int(m[2])}.{m[3]}"
            names[n] = g
        out[key] = names
    return out


def join_ranks(ranks: dict[tuple[int, int, int], Rank], what: str) -> tuple[list[str], dict, dict, list[str]]:
    """(global registration order, weights by global name, {STATE_KEYS: arrays by global name}, notes):
    the ranks joined over tp (`join`), pp (layer offsets) and ep (experts). Dense params are read from ep
    rank 0 (the others hold copies); a tp-replicated param from tp rank 0 (a note says if the others'
    copies differ)."""
    tps, pps, eps = (sorted({k[i] for k in ranks}) for i in range(3))
    globals_ = global_names(ranks)
    order: list[str] = []
    sources: dict[str, tuple[int, int, str]] = {}  # global name -> (pp, ep, local name)
    for pp in pps:
        experts_done: set[str] = set()
        for n in ranks[0, pp, 0].model:
            if not is_expert(n):
                order.append(globals_[0, pp, 0][n])
                sources[order[-1]] = (pp, 0, n)
                continue
            m = LAYER.fullmatch(n)
            block = m[2] if m else ""
            if block in experts_done:
                continue
            experts_done.add(block)
            for ep in eps:  # this layer's experts, every ep rank's, in order
                for local in ranks[0, pp, ep].model:
                    lm = LAYER.fullmatch(local)
                    if is_expert(local) and (lm[2] if lm else "") == block:
                        order.append(globals_[0, pp, ep][local])
                        sources[order[-1]] = (pp, ep, local)
    if len(set(order)) != len(order):
        dup = next(n for n in order if order.count(n) > 1)
        raise InteropError(f"{what}: two ranks hold {dup} (overlapping pipeline stages or expert ranks?)")
    glu = {key: gated({n: tuple(x.shape) for n, x in r.model.items()}) for key, r in ranks.items()}
    model: dict[str, np.ndarray] = {}
    state: dict[str, dict[str, np.ndarray]] = {k: {} for k in STATE_KEYS}
    notes: list[str] = []
    for g in order:
        pp, ep, local = sources[g]
        pieces = []
        for tp in tps:
            r = ranks[tp, pp, ep]
            if local not in r.model:
                raise InteropError(f"{what}: tensor-parallel rank {tp} (pipeline stage {pp}) has no {local}")
            pieces.append(r.model[local])
        shapes = {tuple(p.shape) for p in pieces}
        if len(shapes) > 1:
            raise InteropError(f"{what}: the tensor-parallel slices of {g} have different shapes {sorted(shapes)}")
        if tp_dim(local) is None and len(pieces) > 1 and any(not np.array_equal(p, pieces[0]) for p in pieces[1:]):
            notes.append(f"the tensor-parallel copies of {g} differ; read tensor-parallel rank 0's")
        model[g] = join(local, pieces, glu[0, pp, ep])
        for k in STATE_KEYS:
            got = [ranks[tp, pp, ep].state[k].get(local) for tp in tps]
            if any(x is None for x in got):
                tp = next(t for t, x in zip(tps, got) if x is None)
                raise InteropError(f"{what}: the optimizer state of rank (tp {tp}, pp {pp}, ep {ep}) has no {k} of "
                                   f"{local}")  # fmt: skip
            state[k][g] = join(local, got, glu[0, pp, ep])
    return order, model, state, notes


def drop_tied_copy(order: list[str], model: dict, state: dict, what: str) -> None:
    """A tied model under pipeline parallelism: the last stage's `output_layer.weight` is a copy of the
    first stage's word embeddings (Megatron keeps both equal, weights and optimizer state). Checks that
    they are equal, bit for bit, and drops the copy."""
    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    if emb not in model:
        raise InteropError(f"{what}: a tied output layer without {emb}")
    for key, a, b in [("weights", model[emb], model[out])] + [(k, state[k][emb], state[k][out]) for k in STATE_KEYS]:
        if a.shape != b.shape or not np.array_equal(a, b):
            raise InteropError(
                f"{what}: the last pipeline stage's copy of the tied embedding (output_layer.weight) differs from "
                f"{emb} in its {key}; jzero reads a tied model only when both copies are equal"
            )
    order.remove(out)
    del model[out]
    for k in STATE_KEYS:
        del state[k][out]


def mp_folder(tp: int, pp: int, ep: int, pp_size: int, ep_size: int) -> str:
    """Megatron-LM's legacy folder of model-parallel rank (tp, pp, ep): `mp_rank_{tp:02d}`, then `_{pp:03d}`
    when the run has pipeline parallelism, then `_{ep:03d}` when it has expert parallelism."""
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_size > 1 else "") + (f"_{ep:03d}" if ep_size > 1 else "")


def rank_names(
    order: Sequence[str], tp: int, pp: int, ep: int, tied: bool, what: str
) -> dict[tuple[int, int, int], list[tuple[str, str]]]:
    """Per model-parallel rank (tp, pp, ep), its (local name, global name) pairs in its registration order,
    for the whole model's keys `order` (registration order; `_extra_state` keys go with their module):
    the module docstring's rules. A tied model (`tied`: no output layer of its own) under pipeline
    parallelism gets its last stage's copy of the embedding, (`output_layer.weight`, the embedding's
    name). Raises InteropError where the model does not divide: layers over `pp`, experts over `ep`."""
    if min(tp, pp, ep) < 1:
        raise InteropError(f"{what}: model-parallel sizes {tp}, {pp}, {ep} must be >= 1")
    layer_of = {n: int(m[2]) for n in order if (m := LAYER.fullmatch(n))}
    layers = sorted(set(layer_of.values()))
    if layers != list(range(len(layers))):
        raise InteropError(f"{what}: its layers are numbered {layers[:8]}, not 0, 1, ...")
    if pp > 1 and (not layers or len(layers) % pp):
        raise InteropError(
            f"{what}: {len(layers)} layers do not divide over {pp} pipeline stages (--pipeline-model-parallel-size); "
            "jzero writes and reads even stages"
        )
    per_stage = len(layers) // pp if layers else 0
    experts = sorted({int(m[2]) for n in order if (m := EXPERT.fullmatch(n))})
    if ep > 1 and not experts:
        raise InteropError(f"{what}: expert parallelism {ep} (--expert-model-parallel-size) for a dense model")
    if ep > 1 and len(experts) % ep:
        raise InteropError(
            f"{what}: {len(experts)} experts do not divide over {ep} expert-parallel ranks "
            "(--expert-model-parallel-size)"
        )
    per_ep = len(experts) // ep if experts else 0
    first_layer = next((i for i, n in enumerate(order) if n in layer_of), len(order))
    out: dict[tuple[int, int, int], list[tuple[str, str]]] = {}
    for t, p, e in np.ndindex(tp, pp, ep):
        local: list[tuple[str, str]] = []
        for i, n in enumerate(order):
            if n in layer_of:
                if layer_of[n] // per_stage != p:
                    continue
                m = EXPERT.fullmatch(n)
                if m and int(m[2]) // per_ep != e:
                    continue
                name = f"{m[1]}{int(m[2]) % per_ep}.{m[3]}" if m else n
                lm = LAYER.fullmatch(name)
                name = f"{lm[1]}{int(lm[2]) - p * per_stage}.{lm[3]}"
            elif (p != 0 and i < first_layer) or (p != pp - 1 and i > first_layer):
                continue  # before the layers: the first stage's; after them: the last stage's
            else:
                name = n
            local.append((name, n))
        if tied and pp > 1 and p == pp - 1:  # the copy, where Megatron registers its output layer
            at = next((i for i, (n, _) in enumerate(local) if n == f"output_layer.{EXTRA_STATE}"), len(local))
            local.insert(at, (OUTPUT, EMBEDDING))
        out[int(t), int(p), int(e)] = local
    return out


def split_ranks(
    order: Sequence[str], arrays: dict[str, np.ndarray], tp: int, pp: int, ep: int, tied: bool, what: str
) -> dict[tuple[int, int, int], dict[str, np.ndarray]]:
    """Per model-parallel rank, its local arrays by local name (registration order): `arrays` (the whole
    model's, by global name; a key of `order` without an array, an `_extra_state`, is left out) cut by
    `rank_names` and `split`. `join_ranks` is its inverse."""
    glu = gated({n: tuple(x.shape) for n, x in arrays.items()})
    pieces: dict[str, list[np.ndarray]] = {}
    out = {}
    for (t, p, e), names in rank_names(order, tp, pp, ep, tied, what).items():
        local = {}
        for name, g in names:
            if g not in arrays:
                continue
            if g not in pieces:
                pieces[g] = split(g, arrays[g], tp, glu)
            local[name] = pieces[g][t]
        out[t, p, e] = local
    return out
