"""Reading a Megatron-LM distributed-optimizer checkpoint into model space: per-parameter numpy arrays
under Megatron's names (`MegatronCheckpoint`), with torch never imported.

Two formats (docs/megatron.md, "Moving a run between Megatron and jzero"):

  legacy (`--ckpt-format torch`): `iter_N/mp_rank_XX[_YYY[_ZZZ]]/` per model-parallel rank (tp, then
    pp when PP > 1, then ep when EP > 1), each with `model_optim_rng.pt` (the rank's state dict in
    registration order, the iteration, the optimizer's param groups: Adam's hyperparameters and
    `step`, the LR scheduler) and `distrib_optim.pt` (per distributed optimizer, dense then experts
    for a MoE model, the fp32 main params, exp_avg and exp_avg_sq of the rank's buffer, each one
    vector of every bucket's `[offset, offset + numel_unpadded)`, concatenated). The bucket
    boundaries are not recorded: they follow from the params and `--ddp-bucket-size`.
  torch_dist (`torch_dist.TorchDist`): the model's whole tensors (layers stacked), and the optimizer
    state either `dp_reshardable` (per (tp, pp) rank's buffer, and per (ep, pp) rank's expert buffer,
    per bucket b the vector `[offset_b, offset_b + numel_unpadded_b)`, beside the per-bucket sizes)
    or `fully_reshardable` (per param, shaped like the model's tensor).

`read` cuts the buffers back into per-parameter arrays (`jzero.interop.megatron_format`'s layout) and
joins the model-parallel ranks into the whole model (`jzero.interop.megatron_parallel`): the result
is the same for every parallel layout that wrote it. Adam's state of one param dtype per buffer is
read; anything else is refused in one line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jzero.interop import InteropError, torch_format
from jzero.interop.megatron_format import (
    EXTRA_STATE,
    MODEL_FILE,
    OPTIM_FILE,
    TRACKER,
    bucket_positions,
    layout_bucket_numels,
)
from jzero.interop.megatron_parallel import (
    EMBEDDING,
    OUTPUT,
    STATE_KEYS,
    Rank,
    drop_tied_copy,
    is_expert,
    join_ranks,
    split_ranks,
)
from jzero.interop.torch_dist import TorchDist, is_torch_dist


@dataclasses.dataclass
class MegatronCheckpoint:
    """A Megatron checkpoint in model space: per-parameter numpy arrays under Megatron's names (those of
    the same model without tensor, pipeline or expert parallelism: global layer and expert numbers,
    whole tensors).

    Attributes:
      path: the directory read (`iter_N/mp_rank_00`, the `iter_N` folder of several model-parallel ranks,
        or the torch_dist directory).
      format: "legacy", "torch_dist (dp_reshardable)" or "torch_dist (fully_reshardable)".
      iteration: the checkpoint's iteration (steps done).
      model: the model's weights, in Megatron's registration order (its buffer's order).
      main: the optimizer's fp32 main params (equal to `model` for an fp32 run).
      exp_avg, exp_avg_sq: Adam's moments (torch's: not bias-corrected, as optax's mu and nu).
      adam_step: the `step` in the param groups, None if absent.
      param_groups: the optimizer's param groups as saved (hyperparameters, multipliers; a MoE model's
        dense optimizer's, then its expert optimizer's).
      scheduler: Megatron's OptimizerParamScheduler state, None if absent.
      bucket_numels: per bucket, its unpadded size (Megatron's `per_bucket_numel_unpadded`), of the
        first model-parallel rank's dense buffer; () for fully_reshardable.
      notes: what a user should know about the import, one line each.
      parallel: (tp, pp, ep), the model parallelism that wrote the checkpoint.
    """

    path: Path
    format: str
    iteration: int
    model: dict[str, np.ndarray]
    main: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    adam_step: float | None
    param_groups: list
    scheduler: dict | None
    bucket_numels: tuple[int, ...]
    notes: list[str]
    parallel: tuple[int, int, int] = (1, 1, 1)


_MP_RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


def _mp_ranks(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and _MP_RANK.fullmatch(p.name)) if path.is_dir() else []


def find(path: str | Path) -> Path:
    """The checkpoint directory `path` names: an `iter_N` folder (its `mp_rank_00` for the legacy
    format without model parallelism, else the `iter_N` folder itself), a folder with Megatron's
    `latest_checkpointed_iteration.txt`, or a torch_dist folder."""
    path = Path(path)
    if not path.exists():
        raise InteropError(f"Megatron checkpoint {path} does not exist")
    if path.is_file():
        if path.name in (MODEL_FILE, OPTIM_FILE):
            path = path.parent
        else:
            raise InteropError(f"{path} is a file: give the checkpoint's directory (iter_N, or its parent)")
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        folder = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if folder is None:
            raise InteropError(f"{tracker} holds {text[:40]!r}, not an iteration")
        path = path / folder
        if not path.is_dir():
            raise InteropError(f"{tracker} names iteration {text}, but {path} does not exist")
    ranks = _mp_ranks(path)
    if [p.name for p in ranks] == ["mp_rank_00"]:
        path = ranks[0]
    elif ranks:
        return path
    if (path / MODEL_FILE).is_file() or is_torch_dist(path):
        return path
    raise InteropError(
        f"{path} is not a Megatron checkpoint (no {TRACKER}, iter_N/mp_rank_00/{MODEL_FILE} or torch_dist metadata)"
    )


def read(path: str | Path, *, bucket_size: int | None = None, names: Sequence[str] | None = None) -> MegatronCheckpoint:
    """A Megatron checkpoint (legacy, or torch_dist dp_reshardable or fully_reshardable) in model space.

    Arguments:
      path: see `find`.
      bucket_size: Megatron's `--ddp-bucket-size` for a legacy checkpoint, whose files do not record
        the buckets (torch_dist does; then it is ignored). None: the run's args if the file has them,
        else one bucket (Megatron's layout without `--overlap-grad-reduce`).
      names: the Megatron param names the model expects: which of them a torch_dist checkpoint saves
        under Transformer Engine's names, and whether the model ties its output layer to the
        embedding (no `output_layer.weight` among them) where the checkpoint's args do not say.
    """
    directory = find(path)
    if (directory / MODEL_FILE).is_file():
        return _read_legacy({(0, 0, 0): directory}, directory, bucket_size, names)
    if _mp_ranks(directory):
        return _read_legacy(_legacy_ranks(directory), directory, bucket_size, names)
    return _read_torch_dist(directory, names)


def is_legacy(directory: Path) -> bool:
    """Whether `find`'s `directory` holds the legacy format (one rank's files, or its mp_rank_* folders), not
    torch_dist."""
    return (directory / MODEL_FILE).is_file() or bool(_mp_ranks(directory))


# ---------------------------------------------------------------- the legacy format


def _legacy_bucket_numels(
    directory: Path,
    numels: list[int],
    coalesced: int,
    bucket_size: int | None,
    args: Any,
    shared: list[bool],
    later_stage: bool = False,
) -> tuple[tuple[int, ...], str]:
    source = "bucket_size"
    if later_stage:  # Megatron's DDP buckets the first pipeline stage only
        bucket_size, source = None, "a pipeline stage after the first: one bucket"
    elif bucket_size is None and args is not None and hasattr(args, "ddp_bucket_size"):
        if not getattr(args, "overlap_grad_reduce", True):
            source = "the run's args (no --overlap-grad-reduce: one bucket)"
        else:
            dp = getattr(args, "data_parallel_size", 1) or 1
            bucket_size = args.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)
            source = "the run's args (--ddp-bucket-size)"
    elif bucket_size is None:
        source = "no bucket_size given: one bucket"
    sizes = layout_bucket_numels(numels, bucket_size, shared)
    if sum(sizes) != coalesced:
        raise InteropError(
            f"{directory / OPTIM_FILE} holds {coalesced} elements per state, but Megatron's layout of the model's "
            f"{len(numels)} params with bucket_size={bucket_size} ({source}) has {sum(sizes)}: the file does not "
            "record its buckets, so give the run's --ddp-bucket-size (bucket_size=, --bucket-size)"
        )
    return sizes, source


def _one_buffer(state: Any, what: str) -> tuple[Any, Any]:
    """The single buffer's (dtype key, state) of Megatron's per-buffer structure {0: {key: state}}."""
    if not isinstance(state, dict) or set(state) - {"buckets_coalesced"} != {0}:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise InteropError(
            f"{what}: expected one grad buffer (gbuf 0), found {keys}; jzero reads models of one param dtype"
        )
    by_dtype = state[0]
    if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
        raise InteropError(f"{what}: expected one (param dtype, grad dtype) buffer, found {list(by_dtype)[:4]}")
    return next(iter(by_dtype.items()))


def _param_groups(optimizer: Any, what: str) -> list:
    """The param groups of Megatron's optimizer state dict: {"optimizer": {"param_groups"}} in the legacy
    format, {"param_groups"} in torch_dist's; a list of such (chained optimizers: a MoE model's dense
    and expert ones) gives their groups in order."""
    if isinstance(optimizer, list) and optimizer:
        return [g for o in optimizer for g in _param_groups(o, what)]
    if isinstance(optimizer, dict) and isinstance(optimizer.get("optimizer"), dict):
        optimizer = optimizer["optimizer"]
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list):
        raise InteropError(f"{what}: no optimizer param groups")
    return groups


def _model_order(model: dict, what: str) -> tuple[list[str], dict[str, tuple]]:
    order = [k for k, v in model.items() if isinstance(v, np.ndarray) and not k.endswith(EXTRA_STATE)]
    if not order:
        raise InteropError(f"{what}: the model state dict holds no tensors")
    return order, {k: model[k].shape for k in order}


def _legacy_ranks(directory: Path) -> dict[tuple[int, int, int], Path]:
    """The model-parallel rank folders of an `iter_N` folder by (tp, pp or ep, ep); a two-number suffix is
    resolved by `_resolve_suffix` once the model files are read. Refuses an incomplete set."""
    found: dict[tuple[int, int, int], Path] = {}
    widths = set()
    for p in _mp_ranks(directory):
        m = _MP_RANK.fullmatch(p.name)
        nums = [int(x) for x in m.groups() if x is not None]
        widths.add(len(nums))
        found[(*nums, 0, 0)[:3]] = p
    if len(widths) > 1:
        raise InteropError(f"{directory} mixes model-parallel folder names of {sorted(widths)} numbers")
    sizes = [max(k[i] for k in found) + 1 for i in range(3)]
    for key in np.ndindex(*sizes):
        if key not in found:
            nums = [f"{key[0]:02d}"] + [f"{k:03d}" for k in key[1 : next(iter(widths))]]
            raise InteropError(
                f"{directory} lacks mp_rank_{'_'.join(nums)} of its {math.prod(sizes)} model-parallel ranks "
                f"(tp {sizes[0]}{''.join(f' x {s}' for s in sizes[1 : next(iter(widths))])}): an incomplete checkpoint"
            )
    return found


def _load_model_file(directory: Path) -> dict:
    sd = torch_format.load(directory / MODEL_FILE)
    what = str(directory / MODEL_FILE)
    if not isinstance(sd, dict) or not isinstance(sd.get("model"), dict):
        models = [k for k in sd if isinstance(k, str) and re.fullmatch(r"model\d+", k)] if isinstance(sd, dict) else []
        extra = " (virtual pipeline chunks: model0, model1, ...)" if models else ""
        raise InteropError(f"{what} has no 'model' state dict{extra}")
    return sd


def _suffix_is_ep(files: dict[tuple[int, int, int], dict]) -> bool:
    """Whether the second number of two-number folder names (`mp_rank_XX_YYY`) is the ep rank rather than
    the pp rank (Megatron-LM adds the pp number only when PP > 1, the ep number only when EP > 1): the
    args say, else the model files (every expert-parallel rank holds the whole model, first and last
    stage alike; a pipeline stage does not)."""
    args = next(iter(files.values())).get("args")
    pp_args = getattr(args, "pipeline_model_parallel_size", None)
    if pp_args is not None:
        return pp_args == 1

    def whole(sd):
        return any(k.startswith("embedding.") for k in sd["model"]) and any(
            k.startswith(("decoder.final_layernorm.", "output_layer.")) for k in sd["model"])  # fmt: skip

    return all(whole(sd) for sd in files.values())


def _tied(models: dict[tuple[int, int, int], dict], args: Any, names: Sequence[str] | None) -> bool:
    """Whether a pipeline-parallel model ties its output layer to the embedding: its last stage then
    holds a copy of the embedding as `output_layer.weight`."""
    last = max(k[1] for k in models)
    if last == 0 or OUTPUT not in models[0, last, 0] or EMBEDDING not in models[0, 0, 0]:
        return False
    if names is not None:
        return OUTPUT not in names
    if args is not None and hasattr(args, "untie_embeddings_and_output_weights"):
        return not args.untie_embeddings_and_output_weights
    return all(np.array_equal(models[tp, 0, 0][EMBEDDING], models[tp, last, 0][OUTPUT])
               for tp in {k[0] for k in models})  # fmt: skip


def _optimizer_buffers(optim: Any, owhat: str) -> list:
    """The distributed optimizers' per-buffer states of a `distrib_optim.pt`: [state] for one optimizer,
    [dense or None, experts] for a MoE model's two (chained)."""
    states = optim if isinstance(optim, list) else [optim]
    for s in states:
        if s is not None and (not isinstance(s, dict) or s.get("buckets_coalesced") is not True):
            raise InteropError(
                f"{owhat} is not in Megatron's coalesced format (buckets_coalesced, Megatron-Core >= 0.6): re-save "
                "it with a newer Megatron"
            )
    if not 1 <= len(states) <= 2:
        raise InteropError(f"{owhat}: {len(states)} chained optimizers; jzero reads one, or a MoE model's two")
    return states


def _read_legacy(
    folders: dict[tuple[int, int, int], Path], path: Path, bucket_size: int | None, names: Sequence[str] | None
) -> MegatronCheckpoint:
    files = {k: _load_model_file(d) for k, d in folders.items()}
    two_numbers = len(folders) > 1 and max(len([x for x in _MP_RANK.fullmatch(d.name).groups() if x])
                                           for d in folders.values()) == 2  # fmt: skip
    if two_numbers and _suffix_is_ep(files):
        files = {(k[0], 0, k[1]): sd for k, sd in files.items()}
        folders = {(k[0], 0, k[1]): d for k, d in folders.items()}
    first = files[0, 0, 0]
    iterations = {sd.get("iteration") for sd in files.values()}
    if len(iterations) > 1:
        raise InteropError(f"{path}: its model-parallel ranks hold different iterations {sorted(map(str, iterations))}")
    models = {k: sd["model"] for k, sd in files.items()}
    tied = _tied(models, first.get("args"), names)
    last = max(k[1] for k in models)
    ranks, sizes0, notes = {}, None, []
    for key, directory in sorted(folders.items()):
        sd = files[key]
        what = str(directory / MODEL_FILE)
        order, shapes = _model_order(sd["model"], what)
        if key[0] > 0 and any(is_expert(n) for n in order):
            raise InteropError(f"{path}: a MoE model with tensor parallelism (expert-TP) is not read by jzero")
        if not (directory / OPTIM_FILE).is_file():
            raise InteropError(
                f"{directory} has no {OPTIM_FILE}: jzero reads the distributed optimizer's state "
                "(--use-distributed-optimizer)"
            )
        owhat = str(directory / OPTIM_FILE)
        states = _optimizer_buffers(torch_format.load(directory / OPTIM_FILE), owhat)
        experts = [n for n in order if is_expert(n)]
        if experts and len(states) != 2:
            raise InteropError(f"{owhat}: the model has expert params, but the file holds one optimizer's state")
        buffers = [[n for n in order if not is_expert(n)], experts][: len(states)]
        state: dict[str, dict[str, np.ndarray]] = {k: {} for k in STATE_KEYS}
        for i, (params, opt) in enumerate(zip(buffers, states)):
            if opt is None or not params:
                continue
            shared = [tied and ((n == EMBEDDING and key[1] == 0) or (n == OUTPUT and key[1] == last)) for n in params]
            cut, sizes, source = _legacy_buffer(opt, owhat, directory, params, shapes, bucket_size, sd.get("args"),
                                                shared, key[1] > 0)  # fmt: skip
            for k in STATE_KEYS:
                state[k].update(cut[k])
            if i == 0 and sizes0 is None:
                sizes0 = sizes
                notes.append(f"buckets: {list(sizes)} elements ({source})")
        ranks[key] = Rank(*key, {n: sd["model"][n] for n in order}, state)
    groups = _param_groups(first.get("optimizer"), str(folders[0, 0, 0] / MODEL_FILE))
    fmt = "legacy"
    return _joined(path, fmt, first.get("iteration"), ranks, tied, groups, first.get("opt_param_scheduler"),
                   sizes0 or (), notes)  # fmt: skip


def _legacy_buffer(opt, owhat, directory, params, shapes, bucket_size, args, shared, later_stage=False):
    _, buf = _one_buffer(opt, owhat)
    vectors = {k: buf.get(k) for k in STATE_KEYS}
    if not all(isinstance(v, np.ndarray) and v.ndim == 1 for v in vectors.values()):
        raise InteropError(f"{owhat}: expected vectors param, exp_avg, exp_avg_sq; found {sorted(map(str, buf))}")
    coalesced = len(vectors["param"])
    if any(len(v) != coalesced for v in vectors.values()) or buf.get("numel_unpadded") not in (None, coalesced):
        raise InteropError(f"{owhat} is damaged: its vectors have different lengths")
    numels = [math.prod(shapes[k]) for k in params]
    sizes, source = _legacy_bucket_numels(directory, numels, coalesced, bucket_size, args, shared, later_stage)
    return _cut(vectors, params, shapes, bucket_positions(numels, sizes, owhat), sizes), sizes, source


def _joined(path, fmt, iteration, ranks, tied, groups, scheduler, sizes, notes) -> MegatronCheckpoint:
    """The checkpoint of the joined ranks (`megatron_parallel.join_ranks`), the tied copy dropped."""
    what = str(path)
    order, model, state, join_notes = join_ranks(ranks, what)
    if tied and OUTPUT in model:
        drop_tied_copy(order, model, state, what)
    parallel = tuple(max(k[i] for k in ranks) + 1 for i in range(3))
    if parallel != (1, 1, 1):
        notes = [*notes, "joined {} model-parallel ranks: tp {}, pp {}, ep {}".format(len(ranks), *parallel)]
    cut = {"param": state["param"], "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    return _checkpoint(path, fmt, iteration, model, order, cut, groups, scheduler, sizes, [*notes, *join_notes],
                       parallel)  # fmt: skip


def _checkpoint(directory, fmt, iteration, model, order, cut, groups, scheduler, sizes, notes,
                parallel=(1, 1, 1)) -> MegatronCheckpoint:  # fmt: skip
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise InteropError(f"{directory}: no iteration in the checkpoint (a release checkpoint?)")
    steps = {g.get("step") for g in groups if isinstance(g, dict) and "step" in g}
    adam_step = float(next(iter(steps))) if len(steps) == 1 else None
    say = f"Adam's step count continues from the checkpoint's iteration, {iteration}"
    if adam_step is not None and adam_step != iteration:
        say += (
            f" (its param groups say step {adam_step:g}: Megatron-Core 0.16.1's torch-AdamW fallback resets or "
            "shares that step when it resumes a run, so jzero does not use it)"
        )
    elif len(steps) > 1:
        say += f" (its param groups disagree: steps {sorted(steps)})"
    return MegatronCheckpoint(
        directory, fmt, iteration, {k: model[k] for k in order}, cut["param"], cut["exp_avg"], cut["exp_avg_sq"],
        adam_step, groups, scheduler if isinstance(scheduler, dict) else None, tuple(sizes), [*notes, say],
        tuple(parallel),
    )  # fmt: skip


# ---------------------------------------------------------------- torch_dist


# Megatron's local layer spec saves its norms under Transformer Engine's names in torch_dist (its
# `sharded_state_dict_keys_map`), so that local and TE checkpoints interchange: (TE's, the local name).
_DIST_KEY_MAPS = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)
# A MoE layer's experts, stacked [E, ...] under one key (`TEGroupedMLP`/`SequentialMLP`'s sharded keys)
_STACKED_LAYERS = re.compile(r"(.*\bdecoder\.layers\.)(?!\d+\.)(.*)")  # [L, ...]: the layers' tensors, stacked
_STACKED_EXPERTS = re.compile(r"(.*\.mlp\.experts\.)experts\.(.*)")
_DIST_OPT = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.(.*)")
_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")


def _local_name(key: str, names: Sequence[str] | None) -> str:
    """The name the torch_dist key `key` stands for: Megatron's local-spec name for a norm saved under
    TE's name, unless `names` holds the TE name itself (a model with TE's layer spec)."""
    if names is not None and key in names:
        return key
    for te, local in _DIST_KEY_MAPS:
        if te in key and (names is None or key.replace(te, local) in names):
            return key.replace(te, local)
    return key


def _unstack(td: TorchDist, keys: list[str], prefix: str, names: Sequence[str] | None, what: str) -> dict:
    """The tensors of the model keys `keys` (stored under `prefix` + key) by per-layer, per-expert name,
    in Megatron's registration order: what precedes the layers, layer by layer (each layer's experts
    one after the other), the rest."""
    stacked = [k for k in keys if _STACKED_LAYERS.fullmatch(k)]
    stacks = {k: td.tensor(prefix + k) for k in stacked}
    n_layers = {len(x) for x in stacks.values()}
    if len(n_layers) > 1:
        raise InteropError(f"{what}: layer-stacked tensors of different layer counts {sorted(n_layers)}")
    out: dict[str, np.ndarray] = {}
    for k in keys:
        if k not in stacks:
            out[_local_name(k, names)] = td.tensor(prefix + k)
        elif k == stacked[0]:
            for i in range(next(iter(n_layers))):
                experts: dict[str, np.ndarray] = {}
                for s in stacked:
                    m = _STACKED_LAYERS.fullmatch(s)
                    name = _local_name(f"{m[1]}{i}.{m[2]}", names)
                    m = _STACKED_EXPERTS.fullmatch(name)
                    if m:
                        experts[name] = stacks[s][i]
                        continue
                    out[name] = stacks[s][i]
                if experts:
                    n_experts = {len(x) for x in experts.values()}
                    if len(n_experts) > 1:
                        raise InteropError(f"{what}: expert-stacked tensors of different expert counts")
                    for e in range(next(iter(n_experts))):
                        for name, x in experts.items():
                            m = _STACKED_EXPERTS.fullmatch(name)
                            out[f"{m[1]}local_experts.{e}.{m[2]}"] = x[e]
    return out


def _sharding_type(common: dict, what: str) -> str:
    opt = common.get("optimizer") or {}
    chained = [opt[k] for k in sorted(opt, key=str)] if opt and all(isinstance(k, int) or str(k).isdigit()
                                                                    for k in opt) else [opt]  # fmt: skip
    kinds = {o.get("param_state_sharding_type") if isinstance(o, dict) else None for o in chained}
    kind = next(iter(kinds)) if len(kinds) == 1 else sorted(map(str, kinds))
    if kind == "fully_sharded_model_space":
        raise InteropError(
            f"{what} holds the optimizer state as 'fully_sharded_model_space', which jzero does not read "
            "(Megatron-Core 0.16.1 cannot write it either: ShardedTensor.flattened_range is not supported); save with "
            "dp_reshardable or fully_reshardable"
        )
    if kind not in _SHARDING_TYPES:
        raise InteropError(
            f"{what} holds the optimizer state as {kind!r}; jzero reads torch_dist's dp_reshardable (Megatron-LM's "
            "default) and fully_reshardable, and the legacy format"
        )
    return kind


def _read_torch_dist(directory: Path, names: Sequence[str] | None) -> MegatronCheckpoint:
    td = TorchDist(directory)
    what = str(directory)
    common = td.common
    kind = _sharding_type(common, what)
    model_keys = [k for k in td.keys if not k.startswith(("optimizer.", "chained_")) and td.is_tensor(k)]
    model = _unstack(td, model_keys, "", names, what)
    order, shapes = _model_order(model, what)
    opt_keys = [k for k in td.keys if k.startswith(("optimizer.", "chained_"))]
    if kind == "fully_reshardable":
        return _read_fully_reshardable(td, directory, common, model, order, model_keys, opt_keys, names)
    return _read_dp_reshardable(td, directory, common, model, order, shapes, opt_keys)


def _read_fully_reshardable(td, directory, common, model, order, model_keys, opt_keys, names) -> MegatronCheckpoint:
    """Per param, `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, shaped like the model's tensor."""
    what = str(directory)
    prefixes = [f"optimizer.state.{k}." for k in STATE_KEYS]
    odd = next((k for k in opt_keys if not k.startswith(tuple(prefixes))), None)
    if odd is not None:
        raise InteropError(f"{what}: optimizer key {odd} is not one jzero reads (fully_reshardable: optimizer.state.*)")
    state = {}
    for k, prefix in zip(STATE_KEYS, prefixes):
        keys = [m for m in model_keys if prefix + m in td.keys]
        missing = [m for m in model_keys if prefix + m not in td.keys]
        if missing:
            raise InteropError(f"{what}: no optimizer state {prefix}{missing[0]}")
        state[k] = _unstack(td, keys, prefix, names, what)
    for name in order:  # Megatron-Core 0.16.1 misplaces this state in a buffer of several padded buckets
        x, main = model[name], state["param"][name]
        if x.shape != main.shape or not np.array_equal(main.astype(x.dtype), x):
            raise InteropError(
                f"{what}: the optimizer's main param of {name} is not the model's weight (Megatron-Core 0.16.1 writes "
                "fully_reshardable state misplaced when a buffer has several buckets); save with dp_reshardable"
            )
    groups = _param_groups(_chained(common.get("optimizer"), "optimizer"), what)
    tied = OUTPUT not in model and EMBEDDING in model and (names is None or OUTPUT not in names)
    notes = ["optimizer state per param (fully_reshardable)"] + (["tied output layer: the embedding"] if tied else [])
    return _checkpoint(directory, "torch_dist (fully_reshardable)", common.get("iteration"), model, order, state,
                       groups, common.get("opt_param_scheduler"), (), notes)  # fmt: skip


def _chained(opt: Any, key: str) -> Any:
    """`opt[key]`, or for chained optimizers ({0: {...}, 1: {...}}) the list of each one's."""
    if isinstance(opt, dict) and opt and all(isinstance(k, int) or str(k).isdigit() for k in opt):
        return [o.get(key) for _, o in sorted(opt.items(), key=lambda kv: int(kv[0]))]
    return opt.get(key) if isinstance(opt, dict) else None


def _read_dp_reshardable(td, directory, common, model, order, shapes, opt_keys) -> MegatronCheckpoint:
    """Per distributed optimizer (dense, then experts) and per model-parallel group j (its
    `data_parallel_group_idx`: tp + TP pp for the dense buffers, ep + EP pp for the expert ones), per
    bucket the buffer's `[numel_unpadded]` vectors. Each group's buffer is laid out from its rank's
    local params, which are the whole tensors split as Megatron splits them."""
    what = str(directory)
    groups_by_opt: dict[int, dict[int, set[str]]] = {}
    for k in opt_keys:
        m = _DIST_OPT.fullmatch(k)
        if m is None:
            raise InteropError(f"{what}: optimizer key {k} is not one jzero reads (dp_reshardable)")
        groups_by_opt.setdefault(int(m[1] or 0), {}).setdefault(int(m[2]), set()).add(m[3])
    if not groups_by_opt or not set(groups_by_opt) <= {0, 1}:
        raise InteropError(f"{what}: optimizers {sorted(groups_by_opt)}; jzero reads one, or a MoE model's dense and "
                           "expert ones")  # fmt: skip
    experts = [n for n in order if is_expert(n)]
    if bool(experts) != (1 in groups_by_opt) or 0 not in groups_by_opt:
        raise InteropError(f"{what}: its optimizers ({len(groups_by_opt)}) do not fit a model "
                           f"{'with' if experts else 'without'} experts")  # fmt: skip
    chained = len(groups_by_opt) > 1

    def prefix(opt: int, j: int) -> str:
        return f"{f'chained_{opt}.' if chained else ''}optimizer.distributed.dp_group_idx_{j}."

    def obj(opt: int, j: int, stem: str) -> Any:
        key = next((k for k in opt_keys if k.startswith(prefix(opt, j) + stem + "/")), None)
        if key is None:
            raise InteropError(f"{what}: no {prefix(opt, j)}{stem} in the checkpoint")
        return td.object(key)

    tp = _tp_size(td, model)
    n_dense = len(groups_by_opt[0])
    if sorted(groups_by_opt[0]) != list(range(n_dense)) or n_dense % tp:
        raise InteropError(f"{what}: dense optimizer groups {sorted(groups_by_opt[0])} do not fit tensor parallelism "
                           f"{tp}")  # fmt: skip
    pp = n_dense // tp
    ep = len(groups_by_opt.get(1, ())) // pp if experts else 1
    if experts and (tp > 1 or ep * pp != len(groups_by_opt[1])):
        raise InteropError(f"{what}: expert optimizer groups {sorted(groups_by_opt[1])} do not fit pp {pp}; jzero "
                           "reads experts without tensor parallelism (expert-TP)")  # fmt: skip
    tied = OUTPUT not in model and EMBEDDING in model
    locals_ = split_ranks(order, model, tp, pp, ep, tied, what)
    ranks, sizes0, iteration = {}, None, common.get("iteration")
    for (t, p, e), local in locals_.items():
        state: dict[str, dict[str, np.ndarray]] = {k: {} for k in STATE_KEYS}
        for opt, j, want in ((0, t + tp * p, e == 0), (1, e + ep * p, bool(experts))):
            params = [n for n in local if is_expert(n) == (opt == 1)]
            if not want or not params:
                continue
            sizes = _dist_bucket_sizes(obj(opt, j, "per_bucket_numel_unpadded"), what)
            gwhat = f"{what} ({prefix(opt, j)[:-1]})"
            dtype_key = obj(opt, j, "per_bucket_numel_unpadded")
            vectors = {k: [td.tensor(_vector_key(prefix(opt, j), dtype_key, b, k)) for b in range(len(sizes))]
                       for k in STATE_KEYS}  # fmt: skip
            for k, vs in vectors.items():
                if [len(v) for v in vs] != list(sizes):
                    raise InteropError(f"{gwhat}: bucket vectors of {k} have {[len(v) for v in vs]} elements, not "
                                       f"{list(sizes)}")  # fmt: skip
            lshapes = {n: local[n].shape for n in params}
            numels = [math.prod(lshapes[n]) for n in params]
            cut = _cut(vectors, params, lshapes, bucket_positions(numels, sizes, gwhat), sizes)
            for k in STATE_KEYS:
                state[k].update(cut[k])
            if sizes0 is None:
                sizes0 = sizes
        ranks[t, p, e] = Rank(t, p, e, local, state)
    groups = _param_groups([obj(o, 0, "optimizer") for o in sorted(groups_by_opt)], what)
    groups = [g for x in groups for g in (x if isinstance(x, list) else [x])]
    notes = [f"buckets: {list(sizes0 or ())} elements (recorded in the checkpoint)"]
    ck = _joined(directory, "torch_dist (dp_reshardable)", iteration, ranks, tied, groups,
                 common.get("opt_param_scheduler"), sizes0 or (), notes)  # fmt: skip
    for name, x in model.items():  # the weights are the checkpoint's whole tensors
        ck.model[name] = x
    return ck


def _tp_size(td: TorchDist, model: dict) -> int:
    """Tensor parallelism of a torch_dist checkpoint: how many chunks its vocab-parallel embedding (or
    output layer) is saved in along the vocabulary."""
    for key in (EMBEDDING, OUTPUT):
        if key in td.keys and td.is_tensor(key):
            return len({offsets[0] for offsets, _ in td.chunks(key)})
    return 1


def _dist_bucket_sizes(per_buffer: Any, what: str) -> tuple[int, ...]:
    while isinstance(per_buffer, list) and len(per_buffer) == 1 and isinstance(per_buffer[0], list):
        per_buffer = per_buffer[0]  # [[{key: sizes}]]: Megatron wraps the per-buffer list once more
    if not isinstance(per_buffer, list) or len(per_buffer) != 1 or not isinstance(per_buffer[0], dict):
        raise InteropError(f"{what}: expected one grad buffer, found {str(per_buffer)[:80]}")
    _, sizes = _one_buffer({0: per_buffer[0]}, what)
    return tuple(int(s) for s in sizes)


def _vector_key(prefix: str, per_buffer: Any, bucket: int, key: str) -> str:
    while isinstance(per_buffer, list) and len(per_buffer) == 1:
        per_buffer = per_buffer[0]
    dtype_key = next(iter(per_buffer))
    dtype_name = f"dtype_({dtype_key[0]!r}, {dtype_key[1]!r})" if isinstance(dtype_key, tuple) else str(dtype_key)
    return f"{prefix}gbuf_idx_0.{dtype_name}.bucket_idx_{bucket}.{key}"


def _cut(flat: dict[str, Any], order: list[str], shapes: dict, positions, bucket_numels) -> dict:
    """Per key (param, exp_avg, exp_avg_sq), the state's vectors -> per-param fp32 arrays by name. A key's
    vectors are one per bucket (torch_dist) or one for all buckets, concatenated (legacy)."""
    out: dict[str, dict[str, np.ndarray]] = {k: {} for k in flat}
    offsets = np.cumsum([0, *bucket_numels])
    for name, (b, start) in zip(order, positions):
        n = math.prod(shapes[name])
        for key, vectors in flat.items():
            vec, base = (vectors[b], 0) if isinstance(vectors, list) else (vectors, offsets[b])
            out[key][name] = np.asarray(vec[base + start : base + start + n], np.float32).reshape(shapes[name])
    return out
