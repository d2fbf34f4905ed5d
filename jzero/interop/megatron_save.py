"""Writing a jzero TrainState as Megatron-LM's legacy distributed-optimizer checkpoint, for Megatron to
continue the run (docs/megatron.md, "Moving a run between Megatron and jzero").

`save` writes `iter_N/mp_rank_00/{model_optim_rng.pt, distrib_optim.pt}`: the model's state dict,
the param groups and LR scheduler Megatron checks against its flags (`Hyperparams`), and the fp32
main params and Adam's moments in Megatron's flat buffer (`jzero.interop.megatron_format`), laid
out for the receiving run's `--ddp-bucket-size`.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
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
from jzero.interop.megatron_names import OPTAX_MOMENT, adam_moment, names_per_param
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
    for i, leaf in enumerate(names_per_param(names, zero)):
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
    experts = [k for k in params_order if ".experts." in k]
    if experts:  # Megatron keeps them in a second buffer and optimizer, over the expert-DP group
        raise InteropError(f"{experts[0]} is an expert param: jzero writes Megatron checkpoints of dense models only")
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
