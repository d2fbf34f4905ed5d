"""Megatron-LM's distributed-optimizer checkpoints in and out of jzero: continue a Megatron run in
JAX, and go back (docs/megatron.md, "Moving a run between Megatron and jzero").

Megatron saves the distributed optimizer's state as its flat buffer (docs/megatron.md, "The flat
buffer"): params in reverse registration order, starts aligned to 64 elements, buckets padded for
the DP size. The files keep that layout with the bucket-end padding cut out:

  legacy (`--ckpt-format torch`): `iter_N/mp_rank_00/model_optim_rng.pt` holds the model's state
    dict (registration order), the iteration, the optimizer's param groups (Adam's hyperparameters
    and `step`) and the LR scheduler; `distrib_optim.pt` the fp32 main params, exp_avg and
    exp_avg_sq, each one vector of every bucket's `[offset, offset + numel_unpadded)`, concatenated.
    The bucket boundaries are not recorded: they follow from the params and `--ddp-bucket-size`.
  torch_dist, `dp_reshardable` (`torch_dist.TorchDist`): the model's tensors, and per bucket b the
    vector `[offset_b, offset_b + numel_unpadded_b)`, beside the per-bucket sizes.

Neither depends on the DP size that wrote it (the padding is gone), so a checkpoint loads onto any
jzero mesh, strategy and path. `read` cuts the buffers back into per-parameter arrays (model space,
Megatron's names); `to_train_state` / `load` put them into a `Zero`'s TrainState through its
`from_model_space`; `save` writes the legacy format from a TrainState. `names` says which Megatron
param each jzero param is: a pytree shaped like the params whose leaves are Megatron names, or
`Renamed` where the layouts differ (jzero's GPT: `jzero.interop.gpt`).

Adam's step count: jzero continues from the checkpoint's iteration (its optimizer's counts, hence
the bias correction and the LR schedule, are set to it; `MegatronCheckpoint.notes` says so). The
`step` in the param groups is the same number when Megatron saved a run it trained from the start;
Megatron-Core 0.16.1's torch-AdamW fallback can save another one after it resumed (it resets or
shares the per-param step on load), which jzero reports and does not use.

Only dense models without tensor or pipeline parallelism in the checkpoint (one `mp_rank_00`, one
buffer of one dtype pair) and Adam's state are read; anything else is refused in one line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jzero.interop import InteropError, torch_format
from jzero.interop.torch_dist import TorchDist, is_torch_dist
from jzero.zero import Zero
from jzero.zero.common.state import TrainState, ZeroState
from jzero.zero.flat.buffers import build_layout

PyTree = Any
TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE, OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
EXTRA_STATE = "_extra_state"  # Megatron's per-module extra state (None for its local layers)
MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTAX_MOMENT = {"mu": "exp_avg", "nu": "exp_avg_sq"}  # optax.ScaleByAdamState's fields


class Renamed(NamedTuple):
    """How one jzero param is stored in Megatron: as the params `names`, in that order.

    to_megatron: the jzero array -> one array per name (applied to the params, the fp32 main params
      and each Adam moment alike, so it must be linear in the values: reshapes, transposes, copies).
    from_megatron: the inverse; it raises InteropError if the Megatron arrays hold what jzero's
      param cannot (a bias jzero's model has not, and that is not zero).
    """

    names: tuple[str, ...]
    to_megatron: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    from_megatron: Callable[[tuple[np.ndarray, ...]], np.ndarray]


def renamed(leaf: str | Renamed) -> Renamed:
    """A `names` leaf as a Renamed: a plain name is the same array under that name."""
    if isinstance(leaf, Renamed):
        return leaf
    if not isinstance(leaf, str):
        raise TypeError(f"a names leaf is a Megatron param name or a Renamed, not {type(leaf).__name__}")
    return Renamed((leaf,), lambda x: (x,), lambda xs: xs[0])


@dataclasses.dataclass(frozen=True)
class Hyperparams:
    """What Megatron reads from a legacy checkpoint beside the tensors, for `save`.

    Megatron's loader takes Adam's hyperparameters from the file's param groups (they replace the
    run's flags) and checks its LR scheduler against the run's flags (`--lr`, `--min-lr`,
    `--lr-decay-style`, `--lr-warmup-iters`, `--lr-decay-iters`, `--weight-decay`; or it takes
    them from the file with `--use-checkpoint-opt_param-scheduler`). Megatron's scheduler counts
    samples: iterations x `global_batch`.

    Attributes:
      lr, min_lr: the schedule's peak and floor (`--lr`, `--min-lr`).
      weight_decay, b1, b2, eps: AdamW's (`--weight-decay`, `--adam-beta1/2`, `--adam-eps`).
      warmup_iters, decay_iters, decay_style: the schedule (`--lr-warmup-iters`,
        `--lr-decay-iters` (also the weight-decay schedule's length, as `--train-iters` makes it),
        `--lr-decay-style`: constant, linear, cosine, ...).
      global_batch: samples per iteration (`--global-batch-size`).
      grad_dtype: the grad buffer's dtype, half of Megatron's buffer key (`float32` unless the run
        reduced 16-bit grads: `--accumulate-allreduce-grads-in-fp32` is the bf16 default).
    """

    lr: float
    weight_decay: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    decay_style: str = "constant"
    global_batch: int = 1
    grad_dtype: str = "float32"


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


# ---------------------------------------------------------------- the buffer's layout


def bucket_positions(numels: Sequence[int], bucket_numels: Sequence[int], where: str) -> list[tuple[int, int]]:
    """Per param (registration order), (its bucket, its start in the bucket), for buckets of the given
    unpadded sizes: Megatron's walk in reverse registration order, starts aligned to 64, a bucket
    closing where its recorded size ends (`buffers.build_layout`). Raises InteropError if the params
    do not fill the buckets so."""
    out: list = [None] * len(numels)
    b, cursor = 0, 0
    for i in reversed(range(len(numels))):
        if b >= len(bucket_numels):
            raise InteropError(f"{where}: its {len(bucket_numels)} buckets end before the params do")
        cursor = -(-cursor // 64) * 64
        end = cursor + numels[i]
        if end > bucket_numels[b]:
            raise InteropError(
                f"{where}: the params do not fill its buckets of {list(bucket_numels)} elements in Megatron's "
                "layout (another model, or another param order?)"
            )
        out[i] = (b, cursor)
        cursor = end
        if end == bucket_numels[b]:
            b, cursor = b + 1, 0
    if b != len(bucket_numels):
        raise InteropError(f"{where}: the params end inside bucket {b} of {list(bucket_numels)}")
    return out


def layout_bucket_numels(numels: Sequence[int], bucket_size: int | None) -> tuple[int, ...]:
    """Megatron's per-bucket unpadded sizes for params of `numels` (registration order) and
    `--ddp-bucket-size` (None: one bucket); they do not depend on the DP size."""
    return build_layout(list(numels), dp_size=1, bucket_size=bucket_size).per_bucket_numel_unpadded


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


# ---------------------------------------------------------------- reading


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


# ---------------------------------------------------------------- into jzero


def _leaves(names: PyTree, zero: Zero) -> list[Renamed]:
    """`names` as one Renamed per param (leaves order); it must be shaped like the params."""
    is_leaf = lambda x: isinstance(x, Renamed)  # noqa: E731 (a NamedTuple: a pytree node otherwise)
    want = jax.tree.structure(zero.plan.tensors)
    got = jax.tree.structure(names, is_leaf=is_leaf)
    if got != want:
        raise InteropError(f"names is not shaped like the params: {got.num_leaves} leaves {got}, params {want}"[:300])
    return [renamed(leaf) for leaf in jax.tree.leaves(names, is_leaf=is_leaf)]


def _moment(path) -> str | None:
    """'mu' or 'nu' if the optimizer-state leaf at `path` is one of optax's Adam moments."""
    return next((k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey) and k.name in _OPTAX_MOMENT), None)


def _from_megatron(r: Renamed, arrays: dict[str, np.ndarray], shape, what: str) -> np.ndarray:
    missing = [n for n in r.names if n not in arrays]
    if missing:
        raise InteropError(f"{what} has no param {missing[0]}")
    got = tuple(arrays[n] for n in r.names)
    try:
        x = np.asarray(r.from_megatron(got))
    except (ValueError, TypeError, IndexError):  # a reshape or transpose of arrays of other shapes
        x = None
    if x is None or x.shape != tuple(shape):
        shapes = ", ".join(f"{n} {tuple(a.shape)}" for n, a in zip(r.names, got))
        raise InteropError(f"{what}: Megatron's {shapes} do not give the model's param of shape {tuple(shape)}")
    return x


def to_train_state(ck: MegatronCheckpoint, zero: Zero, names: PyTree) -> TrainState:
    """The train state of `ck` in `zero.shardings` (module docstring): the params (the checkpoint's
    fp32 main params when the model's params are fp32, else its weights), the fp32 main params where
    kept, Adam's moments, and the step: every count of the optimizer state is the iteration.

    `zero`'s optimizer state must be Adam's (optax's ScaleByAdamState mu and nu, and scalar counts);
    any other leaf is refused, naming it.
    """
    what = f"Megatron checkpoint {ck.path}"
    tensors = jax.tree.leaves(zero.plan.tensors)
    leaves = _leaves(names, zero)
    used = {n for r in leaves for n in r.names}
    unused = [n for n in ck.model if n not in used]
    if unused:
        raise InteropError(f"{what}: param {unused[0]} (and {len(unused) - 1} more) has no counterpart in names")

    def per_param(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [_from_megatron(r, arrays, t.shape, what) for r, t in zip(leaves, tensors)]

    main, mu, nu = per_param(ck.main), per_param(ck.exp_avg), per_param(ck.exp_avg_sq)
    index = {tuple(path): i for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(zero.plan.tensors)[0])}
    treedef = jax.tree.structure(zero.plan.tensors)
    abstract_params = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), zero.plan.tensors)
    held = jax.eval_shape(zero.params_from_model, abstract_params)  # what the state holds: the params or bucket shards
    model_abstract = jax.eval_shape(zero.to_model_space, jax.eval_shape(zero.init_opt, held))
    if model_abstract.grad_scaler is not None:
        raise InteropError("float16 params with loss scaling: jzero does not convert Megatron's grad scaler")
    moments = {"exp_avg": mu, "exp_avg_sq": nu}

    def fill(path, leaf):
        owner = zero.plan.param_of(tuple(path))
        field = _moment(path)
        if owner is not None and field is not None and tuple(leaf.shape) == zero.plan.tensor(owner).shape:
            return moments[_OPTAX_MOMENT[field]][index[owner]].astype(leaf.dtype)
        if leaf.shape == () and np.issubdtype(leaf.dtype, np.integer):
            return np.asarray(ck.iteration, leaf.dtype)  # Adam's and the schedules' step counts
        raise InteropError(
            f"optimizer state leaf {jax.tree_util.keystr(tuple(path))} has no counterpart in Megatron's Adam "
            "(exp_avg, exp_avg_sq, step): jzero loads Megatron checkpoints into Adam or AdamW"
        )

    inner = jax.tree_util.tree_map_with_path(fill, model_abstract.inner_state)
    keep_main = model_abstract.main_params is not None
    params = []
    for i, (t, r) in enumerate(zip(tensors, leaves)):
        weights = _from_megatron(r, ck.model, t.shape, what)
        # fp32 params are their own main params (Megatron's and jzero's); else the model copy as saved
        params.append((main[i] if not keep_main or weights.dtype != t.dtype else weights).astype(t.dtype))
    model_opt = ZeroState(
        jax.tree.unflatten(treedef, [m.astype(np.float32) for m in main]) if keep_main else None, inner, None
    )
    model_opt = jax.device_put(model_opt, zero.model_opt_shardings)
    opt = jax.jit(zero.from_model_space, out_shardings=zero.shardings.opt_state)(model_opt)
    # The model's non-trainable state (a MoE router's expert bias) starts from its initial value: its
    # Megatron buffers are not read.
    model_state = None
    if zero.model_state is not None:
        model_state = jax.jit(zero.model_state.init, out_shardings=zero.shardings.model_state)()
    return TrainState(
        zero.params_from_model(jax.device_put(jax.tree.unflatten(treedef, params), zero.model_param_shardings)),
        opt,
        jax.device_put(np.asarray(ck.iteration, np.int32), zero.shardings.step),
        model_state,
    )


def load(path: str | Path, zero: Zero, names: PyTree, *, bucket_size: int | None = None) -> TrainState:
    """Megatron's checkpoint at `path` as `zero`'s TrainState, in `zero.shardings` (`read`,
    `to_train_state`). `names`: a pytree shaped like the params whose leaves are Megatron's param
    names (or `Renamed`); the buffer's param order is read from the checkpoint, not from `names`."""
    flat_names = [n for leaf in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, Renamed))
                  for n in renamed(leaf).names]  # fmt: skip
    return to_train_state(read(path, bucket_size=bucket_size, names=flat_names), zero, names)


# ---------------------------------------------------------------- out of jzero


def _host(x: jax.Array) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _model_space(state: TrainState, zero: Zero) -> tuple[list, list, dict[str, list], int]:
    """(params, fp32 main params, {exp_avg, exp_avg_sq}, Adam's step) on the host, leaves order."""
    opt = jax.jit(zero.to_model_space, out_shardings=zero.model_opt_shardings)(state.opt_state)
    params = [_host(x) for x in jax.tree.leaves(zero.full_params(state.params))]
    main = params if opt.main_params is None else [_host(x) for x in jax.tree.leaves(opt.main_params)]
    index = {tuple(path): i for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(zero.plan.tensors)[0])}
    moments: dict[str, list] = {k: [None] * len(params) for k in MOMENTS}
    counts = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt.inner_state)[0]:
        owner = zero.plan.param_of(tuple(path))
        field = _moment(path)
        if owner is not None and field is not None and leaf.shape == zero.plan.tensor(owner).shape:
            moments[_OPTAX_MOMENT[field]][index[owner]] = _host(leaf).astype(np.float32)
        elif leaf.ndim == 0 and np.issubdtype(leaf.dtype, np.integer):
            counts.add(int(_host(leaf)))
        else:
            raise InteropError(
                f"optimizer state leaf {jax.tree_util.keystr(tuple(path))} has no counterpart in Megatron's Adam "
                "(exp_avg, exp_avg_sq, step)"
            )
    if any(m is None for ms in moments.values() for m in ms) or len(counts) > 1:
        raise InteropError(f"the optimizer state is not Adam's (moments of every param, one step count: {counts})")
    step = counts.pop() if counts else int(_host(state.step))
    return params, [np.asarray(m, np.float32) for m in main], moments, step


def _groups(zero: Zero, hp: Hyperparams, step: int) -> list[dict]:
    """Megatron's param groups: one per (wd_mult, lr_mult) of `zero.groups`, and Megatron's two defaults
    (its loader looks each of its own groups up by these keys; extra ones are ignored)."""
    pairs = {(1.0, 1.0), (0.0, 1.0)}
    if zero.groups is not None:
        leaves = jax.tree.leaves(zero.groups, is_leaf=lambda g: hasattr(g, "wd_mult"))
        pairs |= {(float(g.wd_mult), float(g.lr_mult)) for g in leaves}
    return [
        {
            "wd_mult": wd_mult,
            "lr_mult": lr_mult,
            "is_expert_parallel": False,
            "is_decoupled_lr": False,
            "default_config": True,
            "max_lr": hp.lr,
            "min_lr": hp.min_lr,
            "lr": hp.lr * lr_mult,
            "betas": (hp.b1, hp.b2),
            "eps": hp.eps,
            "weight_decay": hp.weight_decay * wd_mult,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "step": float(step),
        }  # fmt: skip
        for wd_mult, lr_mult in sorted(pairs, reverse=True)
    ]


def _scheduler(hp: Hyperparams, iteration: int) -> dict:
    """Megatron's OptimizerParamScheduler state for `hp` after `iteration` iterations (in samples)."""
    gb = hp.global_batch
    return {
        "max_lr": hp.lr, "lr_warmup_steps": hp.warmup_iters * gb, "num_steps": iteration * gb,
        "lr_decay_style": hp.decay_style, "lr_decay_steps": hp.decay_iters * gb, "min_lr": hp.min_lr,
        "start_wd": hp.weight_decay, "end_wd": hp.weight_decay, "wd_incr_style": "constant",
        "wd_incr_steps": hp.decay_iters * gb,
    }  # fmt: skip


def save(
    path: str | Path,
    state: TrainState,
    zero: Zero,
    names: PyTree,
    *,
    hyperparams: Hyperparams,
    bucket_size: int | None = None,
    order: Sequence[str] | None = None,
) -> Path:
    """Writes `state` as Megatron's legacy checkpoint under `path`: `iter_N/mp_rank_00/{model_optim_rng.pt,
    distrib_optim.pt}` and `latest_checkpointed_iteration.txt`, N the state's step; returns the iter_N folder.

    What Megatron's model loading and `DistributedOptimizer.load_parameter_state` read, with the buffer
    laid out for `bucket_size` (the receiving run's `--ddp-bucket-size`; None: one bucket, Megatron's
    layout without `--overlap-grad-reduce`) and the params in `order`: Megatron's registration order,
    every model state-dict key (keys ending in `_extra_state` are written as None), by default the
    order of `names`' leaves. It must be the receiving model's order, or Megatron lays the state out
    differently. No RNG state and no `args` are written (Megatron-LM: `--no-load-rng`).

    Arrays are gathered whole on the host (as Megatron's own save gathers on DP rank 0); with many
    processes process 0 writes.
    """
    params, main, moments, step = _model_space(state, zero)
    tensors = jax.tree.leaves(zero.plan.tensors)
    iteration = int(_host(state.step))
    per_name: dict[str, dict[str, np.ndarray]] = {k: {} for k in ("model", "param", *MOMENTS)}
    for i, leaf in enumerate(_leaves(names, zero)):
        for key, value in (("model", params[i]), ("param", main[i]), *((k, moments[k][i]) for k in MOMENTS)):
            outs = leaf.to_megatron(np.asarray(value))
            if len(outs) != len(leaf.names):
                raise InteropError(f"names: {tensors[i].name} gives {len(outs)} arrays for {len(leaf.names)} names")
            for n, x in zip(leaf.names, outs):
                if n in per_name[key]:
                    raise InteropError(f"names: Megatron param {n} is given twice")
                per_name[key][n] = np.asarray(x)
    produced = list(per_name["model"])
    order = list(produced if order is None else order)
    params_order = [k for k in order if not k.endswith(EXTRA_STATE)]
    if sorted(params_order) != sorted(produced):
        extra = sorted(set(params_order) ^ set(produced))
        raise InteropError(f"order and names disagree on Megatron params: {', '.join(extra[:4])}")
    numels = [per_name["model"][k].size for k in params_order]
    sizes = layout_bucket_numels(numels, bucket_size)
    positions = bucket_positions(numels, sizes, "save")
    coalesced = {k: np.zeros(sum(sizes), np.float32) for k in ("param", *MOMENTS)}
    offsets = np.cumsum([0, *sizes])
    for name, (b, start) in zip(params_order, positions):
        for k, vec in coalesced.items():
            x = per_name[k][name].astype(np.float32).reshape(-1)
            vec[offsets[b] + start : offsets[b] + start + x.size] = x
    model = OrderedDict((k, None if k.endswith(EXTRA_STATE) else per_name["model"][k]) for k in order)
    param_dtype = torch_format.torch_dtype(per_name["model"][params_order[0]].dtype)
    dtype_key = (param_dtype, torch_format.TorchDType(hyperparams.grad_dtype))
    if len({per_name["model"][k].dtype for k in params_order}) != 1:
        raise InteropError("save: Megatron's distributed optimizer needs one param dtype")
    folder = Path(path) / f"iter_{iteration:07d}"
    if jax.process_index() != 0:
        return folder
    (folder / "mp_rank_00").mkdir(parents=True, exist_ok=True)
    torch_format.save(
        {
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": model,
            "optimizer": {"optimizer": {"param_groups": _groups(zero, hyperparams, step)}},
            "opt_param_scheduler": _scheduler(hyperparams, iteration),
            "num_floating_point_operations_so_far": 0,
        },
        folder / "mp_rank_00" / MODEL_FILE,
    )
    torch_format.save(
        {"buckets_coalesced": True, 0: {dtype_key: {**coalesced, "numel_unpadded": int(sum(sizes))}}},
        folder / "mp_rank_00" / OPTIM_FILE,
    )
    (Path(path) / TRACKER).write_text(str(iteration))
    return folder
