"""Writing a jzero TrainState as Megatron-LM's legacy distributed-optimizer checkpoint, for Megatron to
continue the run (docs/megatron.md, "Moving a run between Megatron and jzero").

`save` writes `iter_N/mp_rank_XX[_YYY][_ZZZ]/{model_optim_rng.pt, distrib_optim.pt}` for the receiving
run's tensor, pipeline and expert model-parallel sizes (one `mp_rank_00` without them): per rank its
slice of the model's state dict (`jzero.interop.megatron_parallel`'s split, the inverse of the import's
join), the param groups and LR scheduler Megatron checks against its flags (`Hyperparams`), and the
fp32 main params and Adam's moments in that rank's flat buffers (`jzero.interop.megatron_format`), laid
out for the receiving run's `--ddp-bucket-size`. `write` does it from model space (whole arrays by
Megatron name), `save` from a jzero TrainState.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import shutil
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero.errors import one_line
from jzero.interop import InteropError, torch_dist, torch_format
from jzero.interop.megatron_format import (
    EXTRA_STATE,
    MODEL_FILE,
    MOMENTS,
    OPTIM_FILE,
    TRACKER,
    bucket_positions,
    layout_bucket_numels,
    refuse_to_overwrite,
)
from jzero.interop.megatron_names import OPTAX_MOMENT, adam_moment, names_per_param
from jzero.interop.megatron_parallel import (
    EMBEDDING,
    LAYER,
    OUTPUT,
    STATE_KEYS,
    gated,
    is_expert,
    mp_folder,
    rank_names,
    split_ranks,
    tp_dim,
)
from jzero.train.preflight import disk_full
from jzero.zero import Zero
from jzero.zero.common.state import TrainState

PyTree = Any


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
        field = adam_moment(path)
        if owner is not None and field is not None and leaf.shape == zero.plan.tensor(owner).shape:
            moments[OPTAX_MOMENT[field]][index[owner]] = _host(leaf).astype(np.float32)
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
            "is_expert_parallel": False,  # Megatron's keys, in its order
            "default_config": True,
            "wd_mult": wd_mult,
            "lr_mult": lr_mult,
            "is_decoupled_lr": False,
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
    parallel: tuple[int, int, int] = (1, 1, 1),
    query_groups: int | None = None,
    ckpt_format: str = "torch",
    data_parallel: int | None = None,
    model_args: dict | None = None,
) -> Path:
    """Writes `state` as Megatron's legacy checkpoint under `path`: `iter_N/mp_rank_XX[_YYY][_ZZZ]/
    {model_optim_rng.pt, distrib_optim.pt}` per model-parallel rank and `latest_checkpointed_iteration.txt`,
    N the state's step; returns the iter_N folder (`write` says what the files hold).

    The params go in `order`: Megatron's registration order, every model state-dict key (keys ending in
    `_extra_state` are written as None), by default the order of `names`' leaves. It must be the
    receiving model's order, or Megatron lays the state out differently. `parallel`: the receiving run's
    (tensor, pipeline, expert) model-parallel sizes; `query_groups`: the model's attention query groups
    (`--num-query-groups`, the heads without grouped-query attention), needed to split QKV over tensor
    parallelism. The fp32 main params and Adam's moments come from the state in model space (any mesh,
    path and strategy). No RNG state and no `args` are written (Megatron-LM: `--no-load-rng`).
    `ckpt_format="torch_dist"`: Megatron's torch_dist with `dp_reshardable` optimizer state instead, for a
    receiving run of data-parallel size `data_parallel` (`write` says more).

    Arrays are gathered whole on the host (as Megatron's own save gathers on DP rank 0); with many
    processes process 0 writes.
    """
    params, main, moments, step = _model_space(state, zero)
    tensors = jax.tree.leaves(zero.plan.tensors)
    iteration = int(_host(state.step))
    per_name: dict[str, dict[str, np.ndarray]] = {k: {} for k in ("model", "param", *MOMENTS)}
    for i, leaf in enumerate(names_per_param(names, zero)):
        for key, value in (("model", params[i]), ("param", main[i]), *((k, moments[k][i]) for k in MOMENTS)):
            outs = leaf.to_megatron(np.asarray(value))
            if len(outs) != len(leaf.names):
                raise InteropError(f"names: {tensors[i].name} gives {len(outs)} arrays for {len(leaf.names)} names")
            for n, x in zip(leaf.names, outs):
                if n in per_name[key]:
                    raise InteropError(f"names: Megatron param {n} is given twice")
                per_name[key][n] = np.asarray(x)
    return write(
        path, iteration=iteration, model=per_name["model"], main=per_name["param"], exp_avg=per_name["exp_avg"],
        exp_avg_sq=per_name["exp_avg_sq"], order=list(per_name["model"]) if order is None else order,
        param_groups=_groups(zero, hyperparams, step), scheduler=_scheduler(hyperparams, iteration),
        bucket_size=bucket_size, grad_dtype=hyperparams.grad_dtype, parallel=parallel, query_groups=query_groups,
        ckpt_format=ckpt_format, data_parallel=data_parallel, model_args=model_args,
    )  # fmt: skip


def _check_divides(model: dict[str, np.ndarray], tp: int, query_groups: int | None, what: str) -> None:
    """One line for a model that tensor parallelism `tp` does not divide as Megatron splits it."""
    if tp == 1:
        return
    expert = next((n for n in model if is_expert(n)), None)
    if expert is not None:
        raise InteropError(
            f"{what}: {expert} is an expert param; jzero writes MoE models without tensor parallelism "
            "(--tensor-model-parallel-size 1: expert-TP is not written)"
        )
    glu = gated({n: tuple(x.shape) for n, x in model.items()})
    for name, x in model.items():
        dim = tp_dim(name)
        if dim is None:
            continue
        if name.endswith((EMBEDDING, OUTPUT)) and x.shape[0] % tp:
            raise InteropError(
                f"{what}: the padded vocabulary of {x.shape[0]} (model.vocab_size) does not divide over tensor "
                f"parallelism {tp} (--tensor-model-parallel-size); pad it to a multiple of {tp}"
            )
        if ".linear_qkv." in name:
            if query_groups is None:
                raise InteropError(f"{what}: splitting {name} over tensor parallelism {tp} needs query_groups")
            if query_groups % tp:
                raise InteropError(
                    f"{what}: {query_groups} attention query groups (model.n_kv_heads, or model.n_heads: "
                    f"--num-query-groups) do not divide over tensor parallelism {tp} (--tensor-model-parallel-size)"
                )
        rows = x.shape[dim] // (2 if ".linear_fc1." in name and name[: name.rindex("linear_fc1.")] in glu else 1)
        if ".linear_fc" in name and rows % tp:
            raise InteropError(
                f"{what}: the MLP's {rows} hidden units (model.d_ff, --ffn-hidden-size) do not divide over tensor "
                f"parallelism {tp} (--tensor-model-parallel-size)"
            )


def _buffer(
    arrays: dict[str, dict[str, np.ndarray]], params: list[str], sizes: tuple[int, ...], dtype_key, where: str
) -> dict:
    """Megatron's `distrib_optim.pt` state of one buffer: per key (param, exp_avg, exp_avg_sq) every bucket's
    `[offset, offset + numel_unpadded)` concatenated, the params at their (bucket, start), gaps 0."""
    numels = [arrays["param"][n].size for n in params]
    positions = bucket_positions(numels, sizes, where)
    coalesced = {k: np.zeros(sum(sizes), np.float32) for k in STATE_KEYS}
    offsets = np.cumsum([0, *sizes])
    for name, (b, start) in zip(params, positions):
        for k, vec in coalesced.items():
            x = arrays[k][name].astype(np.float32).reshape(-1)
            vec[offsets[b] + start : offsets[b] + start + x.size] = x
    return {"buckets_coalesced": True, 0: {dtype_key: {**coalesced, "numel_unpadded": int(sum(sizes))}}}


def write(
    path: str | Path,
    *,
    iteration: int,
    model: dict[str, np.ndarray],
    main: dict[str, np.ndarray],
    exp_avg: dict[str, np.ndarray],
    exp_avg_sq: dict[str, np.ndarray],
    order: Sequence[str],
    param_groups: list[dict],
    scheduler: dict,
    bucket_size: int | None = None,
    grad_dtype: str = "float32",
    parallel: tuple[int, int, int] = (1, 1, 1),
    query_groups: int | None = None,
    tied: bool | None = None,
    ckpt_format: str = "torch",
    data_parallel: int | None = None,
    model_args: dict | None = None,
) -> Path:
    """Writes a model-space state (whole arrays by Megatron name, those of the model without parallelism:
    `MegatronCheckpoint`'s) as Megatron's legacy checkpoint for a run of `parallel` = (tp, pp, ep);
    returns the `iter_{iteration}` folder. Megatron-LM's files, per model-parallel rank (`mp_folder`):

    `model_optim_rng.pt`: the rank's local state dict in registration order (`megatron_parallel.rank_names`:
    its pipeline stage's layers and its expert-parallel rank's experts numbered from 0, tensor-parallel
    slices by `megatron_parallel.split`; `_extra_state` None), the iteration, the optimizer's
    `param_groups` (Adam's hyperparameters, read by Megatron's loader; a MoE model's optimizer is a
    list: the dense one's groups, then the expert one's, marked `is_expert_parallel`), the LR
    `scheduler`'s state.

    `distrib_optim.pt`: per distributed optimizer the rank's buffer (`_buffer`), laid out for
    `bucket_size` on the first pipeline stage (Megatron's DDP buckets no later stage) with a shared
    embedding's own bucket (tied, under pipeline parallelism: both copies of the embedding, each on its
    stage); a MoE model's is the list [dense, experts], the dense state only on ep rank 0 (the dense DP
    group spans the ep ranks), `[None, experts]` on the others. `tied`: whether the output layer is the
    embedding (default: the model has no `output_layer.weight`).

    `ckpt_format="torch_dist"` writes Megatron's `--ckpt-format torch_dist` instead, with `dp_reshardable`
    optimizer state (`_write_torch_dist`): `iter_N/` holds the whole tensors (layers stacked), per
    model-parallel group its buffers' per-bucket vectors, laid out as above and padded for
    `data_parallel`, the receiving run's data-parallel size; `model_args` go into its `args` (Megatron-LM
    compares `num_layers`, `hidden_size`, ... with its flags).
    """
    if ckpt_format not in ("torch", "torch_dist"):
        raise InteropError(f"ckpt_format {ckpt_format!r}: jzero writes Megatron's torch (legacy) and torch_dist")
    tp, pp, ep = (int(x) for x in parallel)
    what = f"Megatron checkpoint for tp {tp}, pp {pp}, ep {ep}"
    for size, flag in ((tp, "tensor"), (pp, "pipeline"), (ep, "expert")):
        if size < 1:
            raise InteropError(f"{what}: {flag}-model-parallel size {size} must be >= 1")
    order = list(order)
    params_order = [k for k in order if not k.endswith(EXTRA_STATE)]
    if sorted(params_order) != sorted(model):
        extra = sorted(set(params_order) ^ set(model))
        raise InteropError(f"order and names disagree on Megatron params: {', '.join(extra[:4])}")
    if len({model[k].dtype for k in params_order}) != 1:
        raise InteropError("save: Megatron's distributed optimizer needs one param dtype")
    tied = (OUTPUT not in model and EMBEDDING in model) if tied is None else tied
    _check_divides(model, tp, query_groups, what)
    whole = {"model": model, "param": main, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    dtype_key = (torch_format.torch_dtype(model[params_order[0]].dtype), torch_format.TorchDType(grad_dtype))
    refuse_to_overwrite(Path(path), iteration)
    if ckpt_format == "torch_dist":
        return _write_torch_dist(path, iteration, whole, order, params_order, param_groups, scheduler, bucket_size,
                                 dtype_key, (tp, pp, ep), tied, data_parallel, model_args, what)  # fmt: skip
    ranks = {k: split_ranks(order, {n: whole[k][n] for n in params_order}, tp, pp, ep, tied, what) for k in whole}
    local_names = rank_names(order, tp, pp, ep, tied, what)
    moe = any(is_expert(n) for n in params_order)
    groups = {"optimizer": {"param_groups": param_groups}}
    if moe:
        experts_groups = [{**g, "is_expert_parallel": True} for g in param_groups]
        groups = [groups, {"optimizer": {"param_groups": experts_groups}}]
    folder = Path(path) / f"iter_{iteration:07d}"
    files = {}
    for (t, p, e), names in local_names.items():
        arrays = {k: ranks[k][t, p, e] for k in whole}
        local = [n for n, _ in names if not n.endswith(EXTRA_STATE)]
        buffers = []
        for i, params in enumerate([[n for n in local if not is_expert(n)], [n for n in local if is_expert(n)]]):
            if i == 1 and not moe:
                continue
            if (i == 0 and e > 0) or not params:  # the dense state is ep rank 0's
                buffers.append(None)
                continue
            shared = [tied and pp > 1 and (n, p) in ((EMBEDDING, 0), (OUTPUT, pp - 1)) for n in params]
            numels = [arrays["param"][n].size for n in params]
            sizes = layout_bucket_numels(numels, bucket_size if p == 0 else None, shared)
            where = f"{what}, {mp_folder(t, p, e, pp, ep)}"
            buffers.append(_buffer(arrays, params, sizes, dtype_key, where))
        model_file = {
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": OrderedDict((n, None if n.endswith(EXTRA_STATE) else arrays["model"][n]) for n, _ in names),
            "optimizer": groups,
            "opt_param_scheduler": scheduler,
            "num_floating_point_operations_so_far": 0,
        }
        files[mp_folder(t, p, e, pp, ep)] = (model_file, buffers if moe else buffers[0])
    if jax.process_index() != 0:
        return folder

    def fill(iter_folder: Path) -> None:
        for name, (model_file, optim) in files.items():
            (iter_folder / name).mkdir(parents=True)
            torch_format.save(model_file, iter_folder / name / MODEL_FILE)
            torch_format.save(optim, iter_folder / name / OPTIM_FILE)

    _write_all_or_nothing(Path(path), iteration, fill)
    return folder


def _write_all_or_nothing(out: Path, iteration: int, fill: Callable[[Path], None]) -> None:
    """Writes `out/iter_N` (`fill(folder)` writes its files into `folder`, made by it) and the tracker, so that a
    failure leaves nothing Megatron would read (it reads the tracker, then iter_N): every byte goes into a fresh
    `iter_N.jzero-tmp-<random>/` beside iter_N first (its `iter_N/` and tracker), then iter_N and the tracker are
    renamed into place, the tracker last. On a failure what this call made is removed (and nothing else); an
    OSError (a full disk, a permission) is raised as one line naming `out`."""
    folder = out / f"iter_{iteration:07d}"
    made = [p for p in (out, *out.parents) if not (p.exists() or p.is_symlink())]  # deepest first
    staging = out / f"{folder.name}.jzero-tmp-{secrets.token_hex(4)}"
    staged = placed = False
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        staged = True
        fill(staging / folder.name)
        (staging / TRACKER).write_text(str(iteration))
        refuse_to_overwrite(out, iteration)  # one that appeared while this call wrote
        os.rename(staging / folder.name, folder)
        placed = True
        os.replace(staging / TRACKER, out / TRACKER)
    except BaseException as e:
        left = [p for p, ours in ((folder, placed), (staging, staged)) if ours and not _remove(p)]
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
        if not isinstance(e, OSError):
            raise
        after = f"remove its partial {' and '.join(map(str, left))}" if left else "nothing was written there"
        if disk_full(e):
            raise InteropError(
                f"no space left (on the device or in the quota) while exporting the Megatron checkpoint to {out}: free "
                f"space there or choose another directory; {after}"
            ) from e
        raise InteropError(f"exporting the Megatron checkpoint to {out} failed: {one_line(e)}; {after}") from e
    _remove(staging)  # empty now; the checkpoint is complete either way


def _remove(tree: Path) -> bool:
    """Removes `tree` (a folder this call made); whether it is gone."""
    shutil.rmtree(tree, ignore_errors=True)
    return not (tree.exists() or tree.is_symlink())


# ---------------------------------------------------------------- torch_dist (dp_reshardable)

# Megatron's local layer spec saves its norms under Transformer Engine's names in torch_dist
# (`megatron_read._DIST_KEY_MAPS`, the other way): (the local name's module, TE's).
_TE_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))  # fmt: skip
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.*)")
MARKER = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
          "common_backend_version": 1}  # fmt: skip
# What Megatron-LM saves as `content_metadata` (its `_build_sharded_state_dict_metadata`) and reads back to
# build the sharded state dict it loads: without it, it assumes an older checkpoint's sharding type.
CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}  # fmt: skip


def _dist_key(name: str, what: str) -> tuple[str, tuple[int, ...]]:
    """(torch_dist key, index into its stacked tensor) of a whole-model name: layers stacked on a leading [L]
    axis, a layer's experts on [L, E] under `mlp.experts.experts.`, the norms under TE's names."""
    m = LAYER.fullmatch(name)
    if m is None:
        return name, ()
    rest, index = m[3], (int(m[2]),)
    e = _LOCAL_EXPERT.fullmatch(rest)
    if e:
        rest, index = f"mlp.experts.experts.{e[2]}", (*index, int(e[1]))
    for local, te in _TE_NAMES:
        if rest.startswith(local):
            rest = te + rest[len(local) :]
    return f"{m[1]}{rest}", index


def _stacked(arrays: dict[str, np.ndarray], names: list[str], what: str) -> dict[str, np.ndarray]:
    """The torch_dist model tensors of `arrays` (whole model, by name): per `_dist_key`, the stack of its
    layers' (and experts') arrays. Refuses a model whose layers differ (each key needs every layer)."""
    groups: dict[str, dict[tuple[int, ...], np.ndarray]] = {}
    for n in names:
        key, index = _dist_key(n, what)
        groups.setdefault(key, {})[index] = arrays[n]
    n_layers = len({int(m[2]) for n in names if (m := LAYER.fullmatch(n))})
    n_experts = len({i[1] for parts in groups.values() for i in parts if len(i) == 2})
    out = {}
    for key, parts in groups.items():
        if list(parts) == [()]:
            out[key] = parts[()]
            continue
        dims = (n_layers, n_experts)[: len(next(iter(parts)))]
        if sorted(parts) != [tuple(int(x) for x in i) for i in np.ndindex(*dims)]:
            raise InteropError(
                f"{what}: torch_dist stacks the layers (and experts) of {key}, but the model has it in only some of "
                "them (mixed layers: write the legacy format, --ckpt-format torch)"
            )
        first = next(iter(parts.values()))
        stack = np.empty((*dims, *first.shape), first.dtype)
        for i, x in parts.items():
            stack[i] = x
        out[key] = stack
    return out


def _extra_state_objects(order: list[str]) -> dict[str, Any]:
    """Megatron's `_extra_state` objects of the layers' modules (None in its local spec, saved as `[None]`):
    `<stacked module>._extra_state/shard_<l>_<L>`, an expert's `shard_<l>.<e>_<L>.<E>`."""
    layers = {int(m[2]) for n in order if (m := LAYER.fullmatch(n))}
    experts = {int(e[1]) for n in order if (m := LAYER.fullmatch(n)) and (e := _LOCAL_EXPERT.fullmatch(m[3]))}
    out = {}
    for n in order:
        if not n.endswith(EXTRA_STATE) or not LAYER.fullmatch(n):
            continue
        key, index = _dist_key(n, "")
        shape = (len(layers), len(experts))[: len(index)]
        out[f"{key}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, shape))}"] = [None]
    return out


def _padded(sizes: Sequence[int], dp: int) -> list[int]:
    """Megatron's per-bucket padded sizes for data-parallel size `dp` (each bucket to a multiple of lcm(dp, 128))."""
    div = math.lcm(dp, 128)
    return [-(-int(s) // div) * div for s in sizes]


def _args(parallel, dp: int, iteration: int, scheduler: dict, bucket_size: int | None, model_args: dict | None):
    """The `args` Megatron-LM's torch_dist load reads from common.pt (it takes TP and PP from it, and compares
    the model's sizes): the receiving run's sizes, no RNG state saved (`no_save_rng`)."""
    tp, pp, ep = parallel
    samples = int(scheduler.get("num_steps", 0)) if isinstance(scheduler, dict) else 0
    return torch_format.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1, data_parallel_size=dp, context_parallel_size=1,
        world_size=tp * pp * dp, use_distributed_optimizer=True, ckpt_format="torch_dist",
        ddp_bucket_size=bucket_size, overlap_grad_reduce=bucket_size is not None, iteration=iteration,
        consumed_train_samples=samples, consumed_valid_samples=0, no_save_rng=True, no_save_optim=False,
        dist_ckpt_optim_fully_reshardable=False, **(model_args or {}),
    )  # fmt: skip


def _write_torch_dist(
    path, iteration, whole, order, params_order, param_groups, scheduler, bucket_size, dtype_key, parallel, tied,
    data_parallel, model_args, what,
) -> Path:  # fmt: skip
    """`write`'s torch_dist: Megatron's `dist_checkpointing.save` of a GPT with `dp_reshardable` optimizer state
    (Megatron-LM's default), for a run of `parallel` and `data_parallel` (its DP size: the buckets' padded
    sizes, `per_bucket_numel`, depend on it)."""
    tp, pp, ep = parallel
    moe = any(is_expert(n) for n in params_order)
    if data_parallel is None or data_parallel < 1 or data_parallel % ep:
        raise InteropError(
            f"{what}: torch_dist needs the receiving run's data-parallel size (--data-parallel-size, a multiple of "
            f"the expert-parallel size {ep}), not {data_parallel}: its buckets are padded for it"
        )
    expert_dp = data_parallel * tp // ep
    folder = Path(path) / f"iter_{iteration:07d}"
    tensors = _stacked(whole["model"], params_order, what)
    objects = _extra_state_objects(order)
    ranks = {k: split_ranks(order, {n: whole[k][n] for n in params_order}, tp, pp, ep, tied, what)
             for k in ("param", *MOMENTS)}  # fmt: skip
    dtype_name = f"dtype_({dtype_key[0]!r}, {dtype_key[1]!r})"
    experts_groups = [{**g, "is_expert_parallel": True} for g in param_groups]
    optim: dict[str, np.ndarray] = {}
    for (t, p, e), names in rank_names(order, tp, pp, ep, tied, what).items():
        local = [n for n, _ in names if not n.endswith(EXTRA_STATE)]
        for opt, j, want, dp in ((0, t + tp * p, e == 0, data_parallel), (1, e + ep * p, moe and t == 0, expert_dp)):
            params = [n for n in local if is_expert(n) == (opt == 1)]
            if not want or not params:
                continue
            arrays = {k: ranks[k][t, p, e] for k in ranks}
            shared = [tied and pp > 1 and (n, p) in ((EMBEDDING, 0), (OUTPUT, pp - 1)) for n in params]
            numels = [arrays["param"][n].size for n in params]
            sizes = layout_bucket_numels(numels, bucket_size if p == 0 else None, shared)
            where = f"{what}, {mp_folder(t, p, e, pp, ep)}"
            vectors = {k: [np.full(s, np.nan, np.float32) for s in sizes] for k in STATE_KEYS}
            for name, (b, start) in zip(params, bucket_positions(numels, sizes, where)):
                for k in STATE_KEYS:
                    x = arrays[k][name].astype(np.float32).reshape(-1)
                    vectors[k][b][start : start + x.size] = x
            prefix = f"{f'chained_{opt}.' if moe else ''}optimizer.distributed.dp_group_idx_{j}."
            for b in range(len(sizes)):
                for k in STATE_KEYS:
                    optim[f"{prefix}gbuf_idx_0.{dtype_name}.bucket_idx_{b}.{k}"] = vectors[k][b]
            objects[f"{prefix}optimizer/shard_0_1"] = [{"param_groups": experts_groups if opt else param_groups}]
            objects[f"{prefix}per_bucket_numel/shard_0_1"] = [[{dtype_key: _padded(sizes, dp)}]]
            objects[f"{prefix}per_bucket_numel_unpadded/shard_0_1"] = [[{dtype_key: [int(s) for s in sizes]}]]
    sharding = {"param_state_sharding_type": "dp_reshardable"}
    common = {
        "checkpoint_version": 3.0, "iteration": iteration, "opt_param_scheduler": scheduler,
        "optimizer": {0: dict(sharding), 1: dict(sharding)} if moe else sharding,
        "num_floating_point_operations_so_far": 0,
        "args": _args(parallel, data_parallel, iteration, scheduler, bucket_size, model_args),
        "content_metadata": dict(CONTENT_METADATA),
    }  # fmt: skip
    if jax.process_index() != 0:
        return folder
    vocab = {k: tp for k in (EMBEDDING, OUTPUT) if k in tensors}  # its chunks tell a reader the tp size
    _write_all_or_nothing(
        Path(path), iteration,
        lambda iter_folder: torch_dist.write(iter_folder, {**tensors, **optim}, objects, common, MARKER, vocab),
    )  # fmt: skip
    return folder
