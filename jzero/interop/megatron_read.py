"""Reading a Megatron-LM distributed-optimizer checkpoint into model space: per-parameter numpy arrays
under Megatron's names (`MegatronCheckpoint`), with torch never imported.

Two formats (docs/megatron.md, "Moving a run between Megatron and jzero"):

  legacy (`--ckpt-format torch`): `iter_N/mp_rank_00/model_optim_rng.pt` holds the model's state
    dict (registration order), the iteration, the optimizer's param groups (Adam's hyperparameters
    and `step`) and the LR scheduler; `distrib_optim.pt` the fp32 main params, exp_avg and
    exp_avg_sq, each one vector of every bucket's `[offset, offset + numel_unpadded)`, concatenated.
    The bucket boundaries are not recorded: they follow from the params and `--ddp-bucket-size`.
  torch_dist, `dp_reshardable` (`torch_dist.TorchDist`): the model's tensors, and per bucket b the
    vector `[offset_b, offset_b + numel_unpadded_b)`, beside the per-bucket sizes.

`read` cuts the buffers back into per-parameter arrays (`jzero.interop.megatron_format`'s layout).
Only dense models without tensor or pipeline parallelism in the checkpoint (one `mp_rank_00`, one
buffer of one dtype pair) and Adam's state are read; anything else is refused in one line.
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
    MOMENTS,
    OPTIM_FILE,
    TRACKER,
    bucket_positions,
    layout_bucket_numels,
)
from jzero.interop.torch_dist import TorchDist, is_torch_dist


@dataclasses.dataclass
class MegatronCheckpoint:
    """A Megatron checkpoint in model space: per-parameter numpy arrays under Megatron's names.

    Attributes:
      path: the directory read (`iter_N/mp_rank_00` or the torch_dist directory).
      format: "legacy" or "torch_dist (dp_reshardable)".
      iteration: the checkpoint's iteration (steps done).
      model: the model's weights, in Megatron's registration order (its buffer's order).
      main: the optimizer's fp32 main params (equal to `model` for an fp32 run).
      exp_avg, exp_avg_sq: Adam's moments (torch's: not bias-corrected, as optax's mu and nu).
      adam_step: the `step` in the param groups, None if absent.
      param_groups: the optimizer's param groups as saved (hyperparameters, multipliers).
      scheduler: Megatron's OptimizerParamScheduler state, None if absent.
      bucket_numels: per bucket, its unpadded size (Megatron's `per_bucket_numel_unpadded`).
      notes: what a user should know about the import, one line each.
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


def find(path: str | Path) -> Path:
    """The checkpoint directory `path` names: an `iter_N` folder (its `mp_rank_00` for the legacy
    format), a folder with Megatron's `latest_checkpointed_iteration.txt`, or a torch_dist folder."""
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
    if (path / "mp_rank_00").is_dir():
        others = sorted(p.name for p in path.iterdir() if p.name.startswith("mp_rank_") and p.name != "mp_rank_00")
        if others:
            raise InteropError(
                f"{path} holds tensor- or pipeline-parallel shards ({', '.join(others[:3])}); jzero reads checkpoints "
                "of tp = pp = 1"
            )
        path = path / "mp_rank_00"
    if (path / MODEL_FILE).is_file() or is_torch_dist(path):
        return path
    raise InteropError(
        f"{path} is not a Megatron checkpoint (no {TRACKER}, iter_N/mp_rank_00/{MODEL_FILE} or torch_dist metadata)"
    )


def read(path: str | Path, *, bucket_size: int | None = None, names: Sequence[str] | None = None) -> MegatronCheckpoint:
    """A Megatron checkpoint (legacy or torch_dist dp_reshardable) in model space.

    Arguments:
      path: see `find`.
      bucket_size: Megatron's `--ddp-bucket-size` for a legacy checkpoint, whose files do not record
        the buckets (torch_dist does; then it is ignored). None: the run's args if the file has them,
        else one bucket (Megatron's layout without `--overlap-grad-reduce`).
      names: the Megatron param names the model expects; lets a torch_dist checkpoint's layer-stacked
        tensors (`decoder.layers.mlp.linear_fc1.weight`, [L, ...]) be read per layer.
    """
    directory = find(path)
    if (directory / MODEL_FILE).is_file():
        return _read_legacy(directory, bucket_size)
    return _read_torch_dist(directory, names)


def _legacy_bucket_numels(
    directory: Path, numels: list[int], coalesced: int, bucket_size: int | None, args: Any
) -> tuple[tuple[int, ...], str]:
    source = "bucket_size"
    if bucket_size is None and args is not None and hasattr(args, "ddp_bucket_size"):
        if not getattr(args, "overlap_grad_reduce", True):
            source = "the run's args (no --overlap-grad-reduce: one bucket)"
        else:
            dp = getattr(args, "data_parallel_size", 1) or 1
            bucket_size = args.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)
            source = "the run's args (--ddp-bucket-size)"
    elif bucket_size is None:
        source = "no bucket_size given: one bucket"
    sizes = layout_bucket_numels(numels, bucket_size)
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
            f"{what}: expected one grad buffer (gbuf 0), found {keys}; jzero reads dense models of one param dtype"
        )
    by_dtype = state[0]
    if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
        raise InteropError(f"{what}: expected one (param dtype, grad dtype) buffer, found {list(by_dtype)[:4]}")
    return next(iter(by_dtype.items()))


def _param_groups(optimizer: Any, what: str) -> list:
    """The param groups of Megatron's optimizer state dict: {"optimizer": {"param_groups"}} in the legacy
    format, {"param_groups"} in torch_dist's."""
    if isinstance(optimizer, dict) and isinstance(optimizer.get("optimizer"), dict):
        optimizer = optimizer["optimizer"]
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if isinstance(optimizer, list):
        raise InteropError(f"{what}: {len(optimizer)} chained optimizers (expert params?); jzero reads one")
    if not isinstance(groups, list):
        raise InteropError(f"{what}: no optimizer param groups")
    return groups


def _model_order(model: dict, what: str) -> tuple[list[str], dict[str, tuple]]:
    order = [k for k, v in model.items() if isinstance(v, np.ndarray) and not k.endswith(EXTRA_STATE)]
    if not order:
        raise InteropError(f"{what}: the model state dict holds no tensors")
    return order, {k: model[k].shape for k in order}


def _read_legacy(directory: Path, bucket_size: int | None) -> MegatronCheckpoint:
    sd = torch_format.load(directory / MODEL_FILE)
    what = str(directory / MODEL_FILE)
    if not isinstance(sd, dict) or not isinstance(sd.get("model"), dict):
        models = [k for k in sd if isinstance(k, str) and re.fullmatch(r"model\d+", k)] if isinstance(sd, dict) else []
        extra = " (virtual pipeline chunks: model0, model1, ...)" if models else ""
        raise InteropError(f"{what} has no 'model' state dict{extra}")
    order, shapes = _model_order(sd["model"], what)
    if not (directory / OPTIM_FILE).is_file():
        raise InteropError(
            f"{directory} has no {OPTIM_FILE}: jzero reads the distributed optimizer's state "
            "(--use-distributed-optimizer)"
        )
    optim = torch_format.load(directory / OPTIM_FILE)
    owhat = str(directory / OPTIM_FILE)
    if not isinstance(optim, dict) or optim.get("buckets_coalesced") is not True:
        raise InteropError(
            f"{owhat} is not in Megatron's coalesced format (buckets_coalesced, Megatron-Core >= 0.6): re-save it "
            "with a newer Megatron"
        )
    _, buf = _one_buffer(optim, owhat)
    vectors = {k: buf.get(k) for k in ("param", *MOMENTS)}
    if not all(isinstance(v, np.ndarray) and v.ndim == 1 for v in vectors.values()):
        raise InteropError(f"{owhat}: expected vectors param, exp_avg, exp_avg_sq; found {sorted(map(str, buf))}")
    coalesced = len(vectors["param"])
    if any(len(v) != coalesced for v in vectors.values()) or buf.get("numel_unpadded") not in (None, coalesced):
        raise InteropError(f"{owhat} is damaged: its vectors have different lengths")
    numels = [math.prod(shapes[k]) for k in order]
    sizes, source = _legacy_bucket_numels(directory, numels, coalesced, bucket_size, sd.get("args"))
    cut = _cut(vectors, order, shapes, bucket_positions(numels, sizes, owhat), sizes)
    groups = _param_groups(sd.get("optimizer"), what)
    notes = [f"buckets: {list(sizes)} elements ({source})"]
    return _checkpoint(directory, "legacy", sd.get("iteration"), sd["model"], order, cut, groups,
                       sd.get("opt_param_scheduler"), sizes, notes)  # fmt: skip


def _checkpoint(directory, fmt, iteration, model, order, cut, groups, scheduler, sizes, notes) -> MegatronCheckpoint:
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
    )  # fmt: skip


_OPT_PREFIX = "optimizer.distributed.dp_group_idx_0."


# Megatron's local layer spec saves its norms under Transformer Engine's names in torch_dist (its
# `sharded_state_dict_keys_map`), so that local and TE checkpoints interchange: (TE's, the local name).
_DIST_KEY_MAPS = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)


def _local_name(key: str, names: Sequence[str] | None) -> str | None:
    """The name among `names` that the torch_dist key `key` is saved under, if any."""
    if names is None or key in names:
        return key if names is None or key in names else None
    for te, local in _DIST_KEY_MAPS:
        if te in key and key.replace(te, local) in names:
            return key.replace(te, local)
    return None


def _stacked(key: str, names: Sequence[str] | None) -> tuple[str, str] | None:
    """(before, after) if `key` is a layer-stacked tensor `<before>layers.<after>` whose per-layer names
    `<before>layers.<i>.<after>` are (mapped, `_local_name`) among `names`."""
    m = re.fullmatch(r"(.*\blayers\.)(.*)", key)
    if names is not None and m and _local_name(f"{m[1]}0.{m[2]}", names) is not None:
        return m[1], m[2]
    return None


def _read_torch_dist(directory: Path, names: Sequence[str] | None) -> MegatronCheckpoint:
    td = TorchDist(directory)
    what = str(directory)
    common = td.common if isinstance(td.common, dict) else {}
    kind = (common.get("optimizer") or {}).get("param_state_sharding_type")
    if kind != "dp_reshardable":
        raise InteropError(
            f"{directory} holds the optimizer state as {kind!r}; jzero reads torch_dist's dp_reshardable "
            "(Megatron-LM's default) and the legacy format (Megatron-Core 0.16.1's fully_reshardable is wrong with "
            "more than one bucket)"
        )
    opt_keys = [k for k in td.keys if k.startswith("optimizer.")]
    if any(not k.startswith(_OPT_PREFIX) for k in opt_keys):
        odd = next(k for k in opt_keys if not k.startswith(_OPT_PREFIX))
        raise InteropError(f"{what}: optimizer key {odd} (model parallelism, chained optimizers?) is not read")

    def obj(stem: str) -> Any:
        key = next((k for k in opt_keys if k.startswith(_OPT_PREFIX + stem + "/")), None)
        if key is None:
            raise InteropError(f"{what}: no {_OPT_PREFIX}{stem} in the checkpoint")
        return td.object(key)

    per_buffer = obj("per_bucket_numel_unpadded")
    while isinstance(per_buffer, list) and len(per_buffer) == 1 and isinstance(per_buffer[0], list):
        per_buffer = per_buffer[0]  # [[{key: sizes}]]: Megatron wraps the per-buffer list once more
    if not isinstance(per_buffer, list) or len(per_buffer) != 1 or not isinstance(per_buffer[0], dict):
        raise InteropError(f"{what}: expected one grad buffer, found {str(per_buffer)[:80]}")
    dtype_key, sizes = _one_buffer({0: per_buffer[0]}, what)
    sizes = tuple(int(s) for s in sizes)
    groups = obj("optimizer")
    groups = _param_groups(groups[0] if isinstance(groups, list) and len(groups) == 1 else groups, what)

    model_keys = [k for k in td.keys if not k.startswith("optimizer.") and td.is_tensor(k)]
    layers = [k for k in model_keys if _stacked(k, names)]
    model: dict[str, np.ndarray] = {}
    stacks = {k: td.tensor(k) for k in layers}
    n_layers = {len(x) for x in stacks.values()}
    if len(n_layers) > 1:
        raise InteropError(f"{what}: layer-stacked tensors of different layer counts {sorted(n_layers)}")

    def add(key: str, value: np.ndarray) -> None:
        model[_local_name(key, names) or key] = value

    for k in model_keys:  # Megatron's registration order: what precedes the layers, layer by layer, the rest
        if k in stacks:
            if k == layers[0]:
                for i in range(next(iter(n_layers))):
                    for s in layers:
                        before, after = _stacked(s, names)
                        add(f"{before}{i}.{after}", stacks[s][i])
            continue
        add(k, td.tensor(k))
    order, shapes = _model_order(model, what)
    numels = [math.prod(shapes[k]) for k in order]
    dtype_name = f"dtype_({dtype_key[0]!r}, {dtype_key[1]!r})" if isinstance(dtype_key, tuple) else str(dtype_key)
    vectors = {
        k: [td.tensor(f"{_OPT_PREFIX}gbuf_idx_0.{dtype_name}.bucket_idx_{b}.{k}") for b in range(len(sizes))]
        for k in ("param", *MOMENTS)
    }
    for k, vs in vectors.items():
        if [len(v) for v in vs] != list(sizes):
            raise InteropError(f"{what}: bucket vectors of {k} have {[len(v) for v in vs]} elements, not {list(sizes)}")
    cut = _cut(vectors, order, shapes, bucket_positions(numels, sizes, what), sizes)
    notes = [f"buckets: {list(sizes)} elements (recorded in the checkpoint)"]
    return _checkpoint(directory, "torch_dist (dp_reshardable)", common.get("iteration"), model, order, cut, groups,
                       common.get("opt_param_scheduler"), sizes, notes)  # fmt: skip


def _cut(flat: dict[str, np.ndarray], order: list[str], shapes: dict, positions, bucket_numels) -> dict:
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
