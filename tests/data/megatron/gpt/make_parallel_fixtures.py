"""Writes the tensor/pipeline-parallel and MoE GPT fixtures with NVIDIA's Megatron-Core (not run by the tests).

Needs torch (CPU) and megatron-core 0.16.1 (Python 3.11; no GPU) plus psutil (the torch_dist writer
hangs without it); the megatron README in the parent folder names the versions. Usage:

    ~/.cache/megatron-venv/bin/python make_parallel_fixtures.py OUT --variant tp2pp2   # OUT/tp2pp2/{untied,tied}/
    ~/.cache/megatron-venv/bin/python make_parallel_fixtures.py OUT --variant moe_ep2  # OUT/moe_ep2/

(OUT = this folder regenerates the fixtures in place.) For each run the script spawns the gloo processes
itself (torch.multiprocessing, one thread each) and drives Megatron's own GPTModel (local layer spec,
LLaMA-style: RMSNorm, SwiGLU, rope, no biases, grouped-query attention) wrapped in Megatron's
DistributedDataParallel + DistributedOptimizer (ZeRO-1, torch AdamW fallback), through Megatron's
schedules (forward_backward_pipelining_without_interleaving when PP > 1), finalize_model_grads,
ChainedOptimizer.step and OptimizerParamScheduler:

- `tp2pp2`: TP 2 x PP 2 x DP 2 (8 ranks), 4 layers (2 per stage), 2 micro-batches per step; once with
  an untied output layer (`untied/`) and once with share_embeddings_and_output_weights (`tied/`).
- `moe_ep2`: 2 MoE layers of 4 experts (top-2, pre-softmax router, no aux loss, dropless,
  SequentialMLP, alltoall dispatcher), EP 2, TP 1, PP 1, DP 4 (4 ranks; expert-data-parallel 2).

Each run trains 10 steps, saves step 10 in Megatron-LM's legacy layout and as torch_dist with every
DistributedOptimizer sharding type 0.16.1 offers, trains 5 more steps in memory (the continuation),
then loads every checkpoint into a fresh model + optimizer in the same processes and trains the 5
steps again, comparing bit for bit (`summary.json`). A last single-process Megatron run
(TP = PP = EP = DP = 1, same global batches as one rank's micro-batches) starts from the joined
"full" init and checks that the joined params are the TP=1/PP=1 model (`reference_*` in summary.json).

Outputs per run folder: expected.npz, run_config.json, summary.json, checkpoint_structure.json and
the checkpoints (ckpt_legacy/, ckpt_torch_dist_<sharding type>/). The README in the parent folder
describes them.

CPU shims (no site-packages edits): a TorchFunctionMode sends Megatron's `cuda` tensors to the CPU and
reports `torch.cuda.*` from the no-arg Tensor.type() (the optimizer dispatches on it); the RNG tracker's
fork is a no-op (no dropout).
"""

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import shutil
import socket
import sys
import time
import traceback
import warnings
import zlib
from functools import partial

import numpy as np

SEED = 20251201
STEPS, CONT = 10, 5
HP = dict(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)  # clip_grad: per run
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")

BASE = dict(
    hidden=16,
    heads=4,
    groups=2,
    kv=4,
    ffn=32,
    vocab=50,
    make_vocab_size_divisible_by=16,
    seq=16,
    mbs=2,
    nmb=2,
)
RUNS = {
    "tp2pp2/untied": dict(
        BASE, clip_grad=0.5, sharding_types=SHARDING_TYPES, tp=2, pp=2, ep=1, dp=2, layers=4, tied=False, moe=False
    ),
    # fully_reshardable is left out here for size (a dev run loaded and resumed it bit for bit)
    "tp2pp2/tied": dict(
        BASE, clip_grad=0.5, sharding_types=("dp_reshardable",), tp=2, pp=2, ep=1, dp=2, layers=4, tied=True, moe=False
    ),
    "moe_ep2": dict(
        BASE,
        sharding_types=SHARDING_TYPES,
        tp=1,
        pp=1,
        ep=2,
        dp=4,
        layers=2,
        tied=False,
        moe=True,
        experts=4,
        topk=2,
        moe_ffn=16,
        clip_grad=0.4,
    ),  # its grad norms are 0.3..0.5: clipping in about half the steps
}
VARIANT_RUNS = {"tp2pp2": ["tp2pp2/untied", "tp2pp2/tied"], "moe_ep2": ["moe_ep2"]}


def padded_vocab(c):
    """Megatron-LM's _vocab_size_with_padding: up to a multiple of make_vocab_size_divisible_by * TP."""
    m = c["make_vocab_size_divisible_by"] * c["tp"]
    return -(-c["vocab"] // m) * m


def full_shapes(c):
    """The full (TP = PP = EP = 1) model's params: name -> shape."""
    H, V, F = c["hidden"], padded_vocab(c), c["ffn"]
    s = {"embedding.word_embeddings.weight": (V, H)}
    for layer in range(c["layers"]):
        p = f"decoder.layers.{layer}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "self_attention.linear_qkv.weight"] = ((c["heads"] + 2 * c["groups"]) * c["kv"], H)
        s[p + "self_attention.linear_proj.weight"] = (H, c["heads"] * c["kv"])
        s[p + "pre_mlp_layernorm.weight"] = (H,)
        if c["moe"]:
            s[p + "mlp.router.weight"] = (c["experts"], H)
            for e in range(c["experts"]):
                s[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * c["moe_ffn"], H)
                s[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (H, c["moe_ffn"])
        else:
            s[p + "mlp.linear_fc1.weight"] = (2 * F, H)
            s[p + "mlp.linear_fc2.weight"] = (H, F)
    s["decoder.final_layernorm.weight"] = (H,)
    if not c["tied"]:
        s["output_layer.weight"] = (V, H)
    return s


def make_problem(c):
    """Full init (per-name generators: independent of order) and the batches of all 15 steps."""
    init = {}
    for name, shape in full_shapes(c).items():
        g = np.random.default_rng([SEED, zlib.crc32(name.encode())])
        if len(shape) == 1:
            init[name] = (1.0 + 0.1 * g.standard_normal(shape)).astype(np.float32)
        else:
            init[name] = (0.1 * g.standard_normal(shape)).astype(np.float32)
    gb = c["mbs"] * c["nmb"] * c["dp"]
    g = np.random.default_rng([SEED, 7])
    seqs = g.integers(0, c["vocab"], (STEPS + CONT, gb, c["seq"] + 1)).astype(np.int64)
    return init, seqs[:, :, :-1].copy(), seqs[:, :, 1:].copy(), np.ones((STEPS + CONT, gb, c["seq"]), np.float32)


# ----------------------------------------------------------------------------- CPU shims


def cpu_shims():
    import torch
    from torch.overrides import TorchFunctionMode

    def is_cuda(d):
        if isinstance(d, bool):
            return False
        return (
            isinstance(d, int)
            or (isinstance(d, str) and d.startswith("cuda"))
            or (isinstance(d, torch.device) and d.type == "cuda")
        )

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            name = getattr(func, "__name__", "")
            if name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
                s = func(*args)
                return "torch.cuda." + s[len("torch.") :] if s.startswith("torch.") and "cuda" not in s else s
            if name == "cuda" and args and isinstance(args[0], torch.Tensor):
                return args[0]
            if "device" in kwargs and is_cuda(kwargs["device"]):
                kwargs["device"] = "cpu"
            if name == "to" and len(args) >= 2 and is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    mode = CudaToCpu()
    mode.__enter__()
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None

    class Stream:  # the MoE alltoall dispatcher's device-to-host stream and event
        def wait_stream(self, other):
            pass

        def record_event(self, *a):
            return self

        def synchronize(self):
            pass

        wait = wait_stream

    default_stream = Stream()
    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda *a, **k: default_stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    # 0.16.1 without Transformer Engine: the router's gating linear tests `te_general_gemm is not None`,
    # a name only bound when TE imports (NameError otherwise); None is what it means to test.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # The alltoall dispatcher turns its split sizes into numpy "device-to-host" only for cuda
    # tensors; on the CPU they stay tensors, which all_to_all_single rejects. Do the same for CPU.
    from megatron.core.transformer.moe import token_dispatcher

    orig_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
    # Autograd runs backward functions without the TorchFunctionMode: the expert all-to-all's
    # backward allocates on device=torch.cuda.current_device(). Run it under the mode.
    from megatron.core.tensor_parallel import mappings

    orig_a2a_backward = mappings._AllToAll.backward

    def a2a_backward(ctx, *grad_output):
        with mode:
            return orig_a2a_backward(ctx, *grad_output)

    mappings._AllToAll.backward = staticmethod(a2a_backward)
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()


# ----------------------------------------------------------------------------- local <-> full


def take(full, sp):
    """The local tensor of `sp` (a TP slice of the full param)."""
    if sp["kind"] == "replicated":
        return full
    if sp["kind"] == "split":
        return np.split(full, sp["parts"], axis=sp["dim"])[sp["index"]]
    gate, up = np.split(full, 2, axis=0)  # "glu": linear_fc1 = [gate; up], each split on its own
    return np.concatenate([np.split(gate, sp["parts"])[sp["index"]], np.split(up, sp["parts"])[sp["index"]]])


def put(full, sp, local, clash):
    """Writes `local` into `full` (NaN = unwritten); records a clash where a replica differs."""
    if sp["kind"] == "replicated":
        idx = np.arange(full.size).reshape(full.shape)
    else:
        idx = take(np.arange(full.size).reshape(full.shape), sp)
    flat = full.reshape(-1)
    old = flat[idx]
    written = ~np.isnan(old)
    if written.any() and not np.array_equal(old[written], local[written]):
        clash.append((sp["full"], float(np.max(np.abs(old[written] - local[written])))))
    flat[idx] = local


def assemble(pieces, shapes):
    """{full name: array} from [(sp, local array)]; checks that replicas agree bit for bit."""
    full = {n: np.full(s, np.nan, np.float32) for n, s in shapes.items()}
    clash = []
    for sp, a in pieces:
        put(full[sp["full"]], sp, a, clash)
    missing = [n for n, a in full.items() if np.isnan(a).any()]
    assert not missing, f"not covered: {missing}"
    return full, clash


# ----------------------------------------------------------------------------- worker


def worker(rank, world, port, run, out, c, reference):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    warnings.filterwarnings("ignore")
    import logging

    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    cpu_shims()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    tp, pp, ep = (1, 1, 1) if reference else (c["tp"], c["pp"], c["ep"])
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    dp = ps.get_data_parallel_world_size()
    assert dp == (1 if reference else c["dp"])
    tp_rank, pp_rank, dp_rank = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )
    ep_rank, edp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    mbs = c["mbs"]
    nmb = c["nmb"] * (c["dp"] if reference else 1)  # reference: one rank runs the whole global batch
    prob = np.load(os.path.join(out, "problem.npz"))
    init = {k[5:]: prob[k] for k in prob.files if k.startswith("init/")}
    TOK, LAB, MASK = prob["tokens"], prob["labels"], prob["loss_mask"]
    V = padded_vocab(c)
    shapes = full_shapes(c)

    moe = {}
    if c["moe"]:
        moe = dict(
            num_moe_experts=c["experts"], moe_router_topk=c["topk"], moe_ffn_hidden_size=c["moe_ffn"],
            moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_pre_softmax=True, moe_token_dispatcher_type="alltoall", moe_router_dtype=None,
            moe_permute_fusion=False, moe_router_fusion=False, expert_model_parallel_size=ep,
        )  # fmt: skip
    config = TransformerConfig(
        num_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
        num_query_groups=c["groups"], kv_channels=c["kv"], ffn_hidden_size=c["ffn"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        add_bias_linear=False, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, layernorm_epsilon=1e-5, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, perform_initialization=True,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        params_dtype=torch.float32, bf16=False, fp16=False, sequence_parallel=False, **moe,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        num_experts=c.get("experts") if c["moe"] else None, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True, bucket_size=None
    )
    opt_config = OptimizerConfig(
        optimizer="adam", lr=HP["lr"], min_lr=0.0, weight_decay=HP["weight_decay"], adam_beta1=HP["adam_beta1"],
        adam_beta2=HP["adam_beta2"], adam_eps=HP["adam_eps"], clip_grad=c["clip_grad"], bf16=False, fp16=False,
        use_distributed_optimizer=True,
    )  # fmt: skip
    gb = mbs * nmb * dp

    def local_spec(inner):
        """{local name: sp}: which slice of which full param each local param is."""
        offset = {}
        for i, layer in enumerate(inner.decoder.layers):
            offset[i] = layer.layer_number - 1  # global 0-based layer index
        res = {}
        for lname, p in inner.named_parameters():
            fname = lname
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", lname)
            is_expert = ".experts." in lname
            if m:
                li = int(m[1])
                rest = m[2]
                m2 = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)", rest)
                if m2:
                    ge = inner.decoder.layers[li].mlp.local_expert_indices[int(m2[1])]
                    rest = f"mlp.experts.local_experts.{ge}.{m2[2]}"
                fname = f"decoder.layers.{offset[li]}.{rest}"
            if c["tied"] and lname == "output_layer.weight":
                fname = "embedding.word_embeddings.weight"  # the last stage's copy of the embedding
            parts = ps.get_expert_tensor_parallel_world_size() if is_expert else tp
            index = ps.get_expert_tensor_parallel_rank() if is_expert else tp_rank
            if getattr(p, "tensor_model_parallel", False) and parts > 1:
                kind = "glu" if lname.endswith("linear_fc1.weight") else "split"
                sp = dict(full=fname, kind=kind, dim=int(p.partition_dim), index=index, parts=parts)
            else:
                sp = dict(full=fname, kind="replicated")
            assert tuple(take(np.empty(shapes[fname]), sp).shape) == tuple(p.shape), (lname, sp, p.shape)
            res[lname] = sp
        return res, offset

    def build(load_init=True):
        # Megatron-LM wires these after building the model; SequentialMLP deep-copies the config,
        # and a bound optimizer method in it would drag process groups into the copy.
        config.grad_scale_func = config.finalize_model_grads_func = config.no_sync_func = None
        inner = GPTModel(
            config, spec, vocab_size=V, max_sequence_length=c["seq"], pre_process=first, post_process=last,
            share_embeddings_and_output_weights=c["tied"], position_embedding_type="rope",
        )  # fmt: skip
        sps, offs = local_spec(inner)
        if load_init:
            with torch.no_grad():
                for n, p in inner.named_parameters():
                    p.copy_(torch.from_numpy(np.ascontiguousarray(take(init[sps[n]["full"]], sps[n]))))
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner)
        opt = get_megatron_optimizer(opt_config, [model])
        sched = OptimizerParamScheduler(
            opt, init_lr=HP["lr"], max_lr=HP["lr"], min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10**6,
            lr_decay_style="constant", start_wd=HP["weight_decay"], end_wd=HP["weight_decay"],
            wd_incr_steps=10**6, wd_incr_style="constant",
        )  # fmt: skip
        return inner, model, opt, sched, sps, offs

    inner, model, opt, sched, sps, offsets = build()
    names = {p: n for n, p in inner.named_parameters()}

    def gather(obj):
        allv = [None] * world
        dist.all_gather_object(allv, obj)
        return allv

    def full_params(inner_):
        pieces = gather([(sps[n], p.detach().numpy().copy()) for n, p in inner_.named_parameters()])
        return assemble([x for r in pieces for x in r], shapes) if rank == 0 else (None, None)

    fwd_bwd = get_forward_backward_func()

    def loss_func(loss_mask, output_tensor):  # Megatron-LM pretrain_gpt.loss_func
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
        return loss, num_tokens, {"lm loss": report}

    def forward_step(data, m):
        b = next(data)
        out_ = m(b["tokens"], b["position_ids"], attention_mask=None, labels=b["labels"])
        return out_, partial(loss_func, b["loss_mask"])

    def batches(step):
        res = []
        for mb in range(nmb):
            rows = slice(mb * mbs * dp + dp_rank * mbs, mb * mbs * dp + (dp_rank + 1) * mbs)
            res.append(
                dict(
                    tokens=torch.from_numpy(TOK[step, rows].copy()),
                    labels=torch.from_numpy(LAB[step, rows].copy()),
                    loss_mask=torch.from_numpy(MASK[step, rows].copy()),
                    position_ids=torch.arange(c["seq"]).expand(mbs, c["seq"]).contiguous(),
                )
            )
        return res

    def train(model_, opt_, sched_, lo, hi):
        config.grad_scale_func = opt_.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = None
        trace = []
        for step in range(lo, hi):
            model_.zero_grad_buffer()
            opt_.zero_grad()
            losses = fwd_bwd(
                forward_step_func=forward_step, data_iterator=iter(batches(step)), model=[model_],
                num_microbatches=nmb, seq_length=c["seq"], micro_batch_size=mbs, forward_only=False,
            )  # fmt: skip
            ok, gnorm, _ = opt_.step()
            lrs = [g["lr"] for g in opt_.param_groups]
            sched_.step(increment=gb)
            loss = None
            if last:  # Megatron-LM training.py: [sum, count] summed over micro-batches, all-reduced over DP
                val = torch.vstack([d["lm loss"].view(-1) for d in losses]).sum(dim=0)
                dist.all_reduce(val, group=ps.get_data_parallel_group())
                loss = float(val[0] / val[1])
            allv = gather(loss)
            loss = next(v for v in allv if v is not None)
            assert all(v is None or v == loss for v in allv)
            gnorm = float(gnorm)
            trace.append(dict(step=step + 1, loss=loss, grad_norm=gnorm, update_successful=bool(ok), lr=lrs,
                              clip_coeff=min(1.0, c["clip_grad"] / (gnorm + 1e-6))))  # fmt: skip
            if rank == 0:
                print(
                    f"[{run}{' reference' if reference else ''}] step {step + 1} loss {loss:.8f} grad_norm {gnorm:.8f}",
                    flush=True,
                )
        return trace

    def dopts(opt_):
        return list(opt_.chained_optimizers) if hasattr(opt_, "chained_optimizers") else [opt_]

    def opt_state_pieces(opt_, inner_):
        """Per owned piece: (local name, pp, sp, local shape, param range, {param, exp_avg, exp_avg_sq, step})."""
        nm = {p: n for n, p in inner_.named_parameters()}
        res = []
        for d in dopts(opt_):
            for gb_ranges in d.gbuf_ranges:
                for buckets in gb_ranges.values():
                    for bmap in buckets:
                        for p, r in bmap["param_map"].items():
                            t = d._get_main_param_and_optimizer_states(p)
                            arr = {k: t[k].detach().numpy().copy() for k in ("param", "exp_avg", "exp_avg_sq")}
                            arr["step"] = float(t["step"]) if "step" in t else None
                            res.append(
                                (
                                    nm[p],
                                    (pp_rank, tp_rank),
                                    sps[nm[p]],
                                    tuple(p.shape),
                                    (r["param"].start, r["param"].end),
                                    arr,
                                )
                            )
        return res

    def full_opt_state(opt_, inner_):
        allp = gather(opt_state_pieces(opt_, inner_))
        if rank != 0:
            return None, None, None
        flat = {}
        steps = set()
        for pieces in allp:
            for ln, ppr, sp, shape, (s, e), arr in pieces:
                key = (ppr, ln, json.dumps(sp, sort_keys=True))  # ppr = (pp, tp): DP ranks own disjoint pieces
                if key not in flat:
                    flat[key] = (
                        sp,
                        shape,
                        {
                            k: np.full(int(np.prod(shape)), np.nan, np.float32)
                            for k in ("param", "exp_avg", "exp_avg_sq")
                        },
                    )
                for k in ("param", "exp_avg", "exp_avg_sq"):
                    dst = flat[key][2][k]
                    assert np.isnan(dst[s:e]).all(), f"{key} owned twice"
                    dst[s:e] = arr[k]
                steps.add(arr["step"])
        res, clashes = {}, []
        for k in ("param", "exp_avg", "exp_avg_sq"):
            pieces = []
            for sp, shape, arrs in flat.values():
                assert not np.isnan(arrs[k]).any()
                pieces.append((sp, arrs[k].reshape(shape)))
            res[k], cl = assemble(pieces, shapes)
            clashes += [(k, *x) for x in cl]
        return res, clashes, sorted(s for s in steps if s is not None)

    # ------------------------------------------------------------------ layout (before training)
    layout = dict(rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, ep_rank=ep_rank, edp_rank=edp_rank,
                  expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
                  groups={
                      "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
                      "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
                      "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
                      "ep": dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
                      "expert_dp": dist.get_process_group_ranks(ps.get_expert_data_parallel_group()),
                  },
                  params=[dict(name=n, shape=list(p.shape), **sps[n],
                               is_expert=not getattr(p, "allreduce", True),
                               shared=bool(getattr(p, "shared", False)),
                               shared_embedding=bool(getattr(p, "shared_embedding", False)))
                          for n, p in inner.named_parameters()],
                  layer_global_index={str(k): v for k, v in offsets.items()},
                  optimizers=[])  # fmt: skip
    for oi, d in enumerate(dopts(opt)):
        od = dict(index=oi, data_parallel_group=dist.get_process_group_ranks(d.data_parallel_group),
                  data_parallel_group_idx=d.data_parallel_group_idx, buffers=[],
                  param_groups=[dict(wd_mult=g.get("wd_mult"), lr_mult=g.get("lr_mult"), weight_decay=g["weight_decay"])
                                for g in d.optimizer.param_groups])  # fmt: skip
        for gi, buf in enumerate(d.buffers):
            key = (buf.param_dtype, buf.grad_dtype)
            bd = dict(
                param_dtype=str(buf.param_dtype), grad_dtype=str(buf.grad_dtype),
                is_expert_buffer=any(buf is b for b in model.expert_parallel_buffers),
                numel=int(buf.numel), numel_unpadded=int(buf.numel_unpadded),
                bucket_indices=[list(map(int, b)) for b in buf.bucket_indices],
                param_index_map={names[p]: [int(s), int(e), int(b)] for p, (s, e, b) in buf.param_index_map.items()},
                buckets=[dict(offset=int(bk.offset), numel_padded=int(bk.grad_data.numel()),
                              numel_unpadded=int(bk.numel_unpadded),
                              gradient_scaling_factor=float(bk.gradient_scaling_factor),
                              params=[names[p] for p in bk.params_list]) for bk in buf.buckets],
                owned=[{names[p]: {k: [int(v.start), int(v.end)] for k, v in r.items()}
                        for p, r in bmap["param_map"].items()} for bmap in d.gbuf_ranges[gi][key]],
            )  # fmt: skip
            od["buffers"].append(bd)
        for g, grange in zip(od["param_groups"], d.opt_group_ranges):
            g["params_owned_by_this_rank"] = [names[p] for p in grange["params"]]
        od["adam_class"] = type(d.optimizer).__module__ + "." + type(d.optimizer).__name__
        layout["optimizers"].append(od)
    layouts = gather(layout)

    init_full, clash0 = full_params(inner)
    if rank == 0:
        assert not clash0 and all(np.array_equal(init_full[n], init[n]) for n in shapes), clash0

    # ------------------------------------------------------------------ train 1..10
    trace = train(model, opt, sched, 0, STEPS)
    p10, clash10 = full_params(inner)
    st10, sclash10, steps10 = full_opt_state(opt, inner)
    status = {}
    if reference:
        if rank == 0:
            t_c = train(model, opt, sched, STEPS, STEPS + CONT)
            p15, _ = full_params(inner)
            np.savez(os.path.join(out, "reference.npz"), **{f"params_step10/{k}": v for k, v in p10.items()},
                     **{f"params_step15/{k}": v for k, v in p15.items()})  # fmt: skip
            with open(os.path.join(out, "reference_trace.json"), "w") as f:
                json.dump(trace + t_c, f, indent=1)
        dist.destroy_process_group()
        return

    # ------------------------------------------------------------------ checkpoints at step 10
    mp_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
    legacy = os.path.join(out, "ckpt_legacy", f"iter_{STEPS:07d}", mp_dir)
    os.makedirs(legacy, exist_ok=True)
    dist.barrier()
    try:
        opt.save_parameter_state(os.path.join(legacy, "distrib_optim.pt"))
        if edp_rank == 0:  # Megatron-LM checkpointing.save_checkpoint: expert-DP rank 0 writes the model file
            sd = {"args": None, "checkpoint_version": 3.0, "iteration": STEPS,
                  "model": inner.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict(),
                  "opt_param_scheduler": sched.state_dict()}  # fmt: skip
            torch.save(sd, os.path.join(legacy, "model_optim_rng.pt"))
        if rank == 0:
            with open(os.path.join(out, "ckpt_legacy", "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(STEPS))
        dist.barrier()
        status["legacy_save"] = "ok"
    except Exception:
        status["legacy_save"] = "FAILED: " + traceback.format_exc()[-1500:]
        dist.barrier()

    def sd_metadata(stype):
        """The metadata Megatron-LM's checkpointing passes to sharded_state_dict (0.16)."""
        md = {"distrib_optim_sharding_type": stype, "singleton_local_shards": False,
              "chained_optim_avoid_prefix": True,
              "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}  # fmt: skip
        if stype == "fully_reshardable":
            md["distrib_optim_fully_reshardable_mem_efficient"] = False
        return md

    cwd = os.getcwd()
    for stype in c["sharding_types"]:
        d = f"ckpt_torch_dist_{stype}"
        try:
            os.chdir(out)  # DCP records the path: a relative one keeps machine paths out
            torch.use_deterministic_algorithms(True)  # torch.empty gaps are NaN instead of garbage
            if rank == 0:
                os.makedirs(d, exist_ok=True)
            dist.barrier()
            md = sd_metadata(stype)
            model_sd = inner.sharded_state_dict(metadata=md)
            opt_sd = opt.sharded_state_dict(model_sd, metadata=md)
            state = {"model": model_sd, "optimizer": opt_sd, "opt_param_scheduler": sched.state_dict(),
                     "iteration": STEPS, "checkpoint_version": 3.0}  # fmt: skip
            dist_checkpointing.save(state, d)
            status[f"torch_dist_{stype}_save"] = "ok"
        except Exception:
            status[f"torch_dist_{stype}_save"] = "FAILED: " + traceback.format_exc()[-1500:]
        finally:
            torch.use_deterministic_algorithms(False)
            os.chdir(cwd)
        ok = gather(status[f"torch_dist_{stype}_save"] == "ok")
        if not all(ok):
            if rank == 0:
                shutil.rmtree(os.path.join(out, d), ignore_errors=True)
            if status[f"torch_dist_{stype}_save"] == "ok":
                status[f"torch_dist_{stype}_save"] = "FAILED on another rank"
        dist.barrier()

    # ------------------------------------------------------------------ continuation 11..15
    local10 = {n: p.detach().clone() for n, p in inner.named_parameters()}
    trace_c = train(model, opt, sched, STEPS, STEPS + CONT)
    p15, clash15 = full_params(inner)
    local15 = {n: p.detach().clone() for n, p in inner.named_parameters()}
    trace_c_key = [(t["loss"], t["grad_norm"]) for t in trace_c]

    # ------------------------------------------------------------------ resume checks
    def keep_step_on_load(opt_):
        """torch AdamW keeps a per-param 'step' that distrib_optim.pt / fully_reshardable do not carry:
        Megatron's _set_main_param_and_optimizer_states raises KeyError('step'). Keep the step tensor
        load_state_dict restored from the param groups."""
        for d in dopts(opt_):
            orig = d._set_main_param_and_optimizer_states

            def wrapped(model_param, tensors, d=d, orig=orig):
                gi, go = d.model_param_group_index_map[model_param]
                st = d.optimizer.state[d.optimizer.param_groups[gi]["params"][go]]
                if "step" in st and "step" not in tensors:
                    tensors = dict(tensors, step=st["step"].clone())
                return orig(model_param, tensors)

            d._set_main_param_and_optimizer_states = wrapped

    def fix_step(opt_):
        """One step tensor per param state holding the param group's step (see the README: after a
        load all states share one tensor; dp_reshardable resets it to 1)."""
        for d in dopts(opt_):
            for g in d.optimizer.param_groups:
                for p in g["params"]:
                    st = d.optimizer.state[p]
                    if "step" in st:
                        st["step"] = torch.tensor(float(g["step"]), dtype=torch.float32)

    def step_state(opt_):
        ts = [st["step"] for d in dopts(opt_) for st in d.optimizer.state.values() if "step" in st]
        ids = [id(x) for x in ts]
        return dict(
            values=sorted({float(x) for x in ts}),
            max_states_sharing_one_tensor=max([ids.count(i) for i in set(ids)] or [0]),
        )

    def load_legacy():
        inner2, model2, opt2, sched2, _, _ = build(load_init=False)
        # every rank of an expert-DP group reads the model file its expert-DP rank 0 wrote
        sd = torch.load(os.path.join(legacy, "model_optim_rng.pt"), weights_only=False)
        keep_step_on_load(opt2)
        with torch.no_grad():
            model2.load_state_dict(sd["model"])
            opt2.load_state_dict(sd["optimizer"])
            opt2.load_parameter_state(os.path.join(legacy, "distrib_optim.pt"))
        sched2.load_state_dict(sd["opt_param_scheduler"])
        return inner2, model2, opt2, sched2

    def load_torch_dist(stype):
        inner2, model2, opt2, sched2, _, _ = build(load_init=False)
        with torch.no_grad():
            for d in dopts(opt2):
                d._init_optimizer_states_with_dummy_values()
        if stype != "dp_reshardable":
            keep_step_on_load(opt2)
        md = sd_metadata(stype)
        model_sd = inner2.sharded_state_dict(metadata=md)
        opt_sd = opt2.sharded_state_dict(model_sd, is_loading=True, metadata=md)
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": opt_sd}, os.path.join(out, f"ckpt_torch_dist_{stype}")
        )
        with torch.no_grad():
            model2.load_state_dict(loaded["model"])
            opt2.load_state_dict(loaded["optimizer"])
        sched2.load_state_dict(loaded["opt_param_scheduler"])
        return inner2, model2, opt2, sched2

    def compare_local(inner2, ref):
        bad = [n for n, p in inner2.named_parameters() if not torch.equal(p.detach(), ref[n])]
        return all(gather(not bad))

    loaders = []
    if status.get("legacy_save") == "ok":
        loaders.append(("legacy", load_legacy))
    for stype in c["sharding_types"]:
        if status.get(f"torch_dist_{stype}_save") == "ok":
            loaders.append((f"torch_dist_{stype}", partial(load_torch_dist, stype)))
    for label, loader in loaders:
        for fixed in (False, True):
            tag = f"{label}_resume" + ("_step_fixed" if fixed else "_as_loaded")
            try:
                inner2, model2, opt2, sched2 = loader()
                params_ok = compare_local(inner2, local10)
                st2, _, _ = full_opt_state(opt2, inner2)
                if rank == 0:
                    state_ok = all(np.array_equal(st2[k][n], st10[k][n]) for k in st2 for n in shapes)
                steps_loaded = gather(step_state(opt2))
                if fixed:
                    fix_step(opt2)
                tr2 = train(model2, opt2, sched2, STEPS, STEPS + CONT)
                same_trace = [(t["loss"], t["grad_norm"]) for t in tr2] == trace_c_key
                same_params = compare_local(inner2, local15)
                if rank == 0:
                    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(tr2, trace_c))
                    status[tag] = dict(
                        loaded_params_bitwise=params_ok, loaded_adam_state_bitwise=bool(state_ok),
                        loaded_step={"values": sorted({v for s in steps_loaded for v in s["values"]}),
                                     "max_states_sharing_one_tensor": max(
                                         s["max_states_sharing_one_tensor"] for s in steps_loaded)},
                        continuation_trace_bitwise=same_trace, continuation_params_step15_bitwise=same_params,
                        max_abs_loss_diff=diff,
                    )  # fmt: skip
            except Exception:
                status[tag] = "FAILED: " + traceback.format_exc()[-2000:]
                print(f"rank {rank} {tag}: {status[tag]}", flush=True)
            dist.barrier()

    statuses = gather(status)
    if rank == 0:
        arrays = {}
        for k, v in init_full.items():
            arrays[f"init/{k}"] = v
        for k, v in p10.items():
            arrays[f"params_step10/{k}"] = v
        for k, v in p15.items():
            arrays[f"params_step15/{k}"] = v
        for kind, d in st10.items():
            for k, v in d.items():
                arrays[f"{'main_param' if kind == 'param' else kind}_step10/{k}"] = v
        full_trace = trace + trace_c
        arrays.update(
            tokens=TOK, labels=LAB, loss_mask=MASK, loss=np.array([t["loss"] for t in full_trace], np.float64),
            grad_norm=np.array([t["grad_norm"] for t in full_trace], np.float64),
        )  # fmt: skip
        np.savez_compressed(os.path.join(out, "expected.npz"), **arrays)
        with open(os.path.join(out, "trace.json"), "w") as f:
            json.dump(full_trace, f, indent=1)

        def js(v):
            return v if isinstance(v, (int, float, bool, str, type(None))) else str(v)

        cfg = dict(
            run=run, megatron_settings=dict(c, vocab_padded=V, global_batch=gb, num_microbatches=nmb,
                                            micro_batch_size=mbs, virtual_pipeline_model_parallel_size=None,
                                            world_size=world, steps=STEPS, continue_steps=CONT, seed=SEED),
            hparams=dict(HP, clip_grad=c["clip_grad"]),
            batch_rows=("global batch row of micro-batch m on DP rank r: m * micro_batch_size * dp + "
                        "r * micro_batch_size + i (Megatron-LM's MegatronPretrainingSampler)"),
            full_param_shapes={k: list(v) for k, v in shapes.items()},
            transformer_config={k: js(v) for k, v in vars(config).items() if not k.startswith("_")},
            ddp_config={k: js(v) for k, v in vars(ddp_config).items()},
            optimizer_config={k: js(v) for k, v in vars(opt_config).items()},
            scheduler=dict(init_lr=HP["lr"], max_lr=HP["lr"], min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10**6,
                           lr_decay_style="constant", start_wd=HP["weight_decay"], end_wd=HP["weight_decay"],
                           wd_incr_style="constant", increment_per_step=gb),
            ranks=layouts,
        )  # fmt: skip
        with open(os.path.join(out, "run_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        summary = dict(
            replica_clashes=dict(init=clash0, step10=clash10, step15=clash15, adam_step10=sclash10),
            adam_step_values_at_step10=steps10,
            main_param_step10_equals_params_step10=all(np.array_equal(st10["param"][n], p10[n]) for n in shapes),
            checkpoint_saves={k: (statuses[0][k] if all(s.get(k) == statuses[0][k] for s in statuses)
                                  else {str(r): s.get(k) for r, s in enumerate(statuses)})
                              for k in statuses[0] if k.endswith("_save")},
            resume_from_step10={k: v for k, v in statuses[0].items() if not k.endswith("_save")},
        )  # fmt: skip
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank, world, port, run, out, c, reference):
    try:
        worker(rank, world, port, run, out, c, reference)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# ----------------------------------------------------------------------------- inspection (launcher)


def _describe(obj, depth=0):
    import torch

    if isinstance(obj, torch.Tensor):
        return f"tensor {str(obj.dtype).replace('torch.', '')} {list(obj.shape)}"
    if depth > 7:
        return type(obj).__name__
    if isinstance(obj, dict):
        return {(k if isinstance(k, str) else repr(k)): _describe(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if len(obj) > 8:
            return [_describe(v, depth + 1) for v in obj[:2]] + [f"... ({len(obj)} items)"]
        return [_describe(v, depth + 1) for v in obj]
    if isinstance(obj, (int, float, bool, str, type(None))):
        return obj
    return type(obj).__name__ + ": " + repr(obj)[:120]


def inspect_checkpoints(out):
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    rep = {}
    for root, _, files in sorted(os.walk(os.path.join(out, "ckpt_legacy"))):
        for fn in sorted(files):
            if fn.endswith(".pt"):
                path = os.path.join(root, fn)
                rep[os.path.relpath(path, out)] = dict(
                    bytes=os.path.getsize(path), structure=_describe(torch.load(path, weights_only=False))
                )
    for name in sorted(os.listdir(out)):
        if not name.startswith("ckpt_torch_dist_"):
            continue
        d = os.path.join(out, name)
        e = {"files": {fn: os.path.getsize(os.path.join(d, fn)) for fn in sorted(os.listdir(d))}}
        e["common.pt"] = _describe(torch.load(os.path.join(d, "common.pt"), weights_only=False))
        md = FileSystemReader(d).read_metadata()
        items = {}
        for k, v in sorted(md.state_dict_metadata.items()):
            if hasattr(v, "chunks"):
                items[k] = dict(dtype=str(v.properties.dtype).replace("torch.", ""), global_shape=list(v.size),
                                chunks=[[list(ch.offsets), list(ch.sizes)] for ch in v.chunks])  # fmt: skip
            else:
                items[k] = type(v).__name__
        e["dcp_items"] = items
        rep[name] = e
    with open(os.path.join(out, "checkpoint_structure.json"), "w") as f:
        json.dump(rep, f, indent=1)


def read_dcp(d):
    """A torch_dist folder's tensors and objects with plain torch (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(d).read_metadata()
    sd = {k: (torch.empty(tuple(m.size), dtype=m.properties.dtype) if hasattr(m, "size") else io.BytesIO())
          for k, m in md.state_dict_metadata.items()}  # fmt: skip
    dcp.load(sd, storage_reader=FileSystemReader(d), no_dist=True)
    return sd


def dist_key(name):
    """(torch_dist key, index into it) of a full param: layers are stacked on a leading [L] axis
    (experts on [L, E]), and the local spec maps the norms to TE's fused-norm names."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not m:
        return name, ()
    layer, rest = int(m[1]), m[2]
    m2 = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)", rest)
    if m2:
        return f"decoder.layers.mlp.experts.experts.{m2[2]}", (layer, int(m2[1]))
    rest = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(rest, rest)  # fmt: skip
    return f"decoder.layers.{rest}", (layer,)


def mp_dir(r, s):
    """Megatron-LM's legacy checkpoint folder of a rank."""
    return (f"mp_rank_{r['tp_rank']:02d}" + (f"_{r['pp_rank']:03d}" if s["pp"] > 1 else "")
            + (f"_{r['ep_rank']:03d}" if s["ep"] > 1 else ""))  # fmt: skip


def verify_checkpoints(out):
    """Reads every checkpoint with plain torch (no Megatron, no process group), the way the README
    describes, and compares every value with expected.npz's step-10 params and Adam state."""
    import torch

    with open(os.path.join(out, "run_config.json")) as f:
        cfg = json.load(f)
    s = cfg["megatron_settings"]
    exp = np.load(os.path.join(out, "expected.npz"))
    shapes = {k: tuple(v) for k, v in cfg["full_param_shapes"].items()}
    kinds = {"param": "params_step10", "exp_avg": "exp_avg_step10", "exp_avg_sq": "exp_avg_sq_step10"}
    want = {k: {n: exp[f"{p}/{n}"] for n in shapes} for k, p in kinds.items()}
    f32 = (torch.float32, torch.float32)
    report = {}

    def flat_checks(get_flat, label):
        """get_flat(rank, opt index, optimizer, gbuf index, buffer) -> {kind: flat tensor with every
        bucket's [offset, offset + numel_unpadded) concatenated} or None (not in this file)."""
        n, bad, seen = 0, [], set()
        for r in cfg["ranks"]:
            sps = {p["name"]: p for p in r["params"]}
            for oi, o in enumerate(r["optimizers"]):
                for gi, b in enumerate(o["buffers"]):
                    flat = get_flat(r, oi, o, gi, b)
                    if flat is None:
                        continue
                    seen.add((oi, tuple(o["data_parallel_group"])))
                    pad_before = np.cumsum([0] + [bk["numel_padded"] - bk["numel_unpadded"] for bk in b["buckets"]])
                    for name, (st, en, bi) in b["param_index_map"].items():
                        sp = sps[name]
                        for k in kinds:
                            got = flat[k][st - pad_before[bi] : en - pad_before[bi]].numpy().reshape(sp["shape"])
                            n += 1
                            if not np.array_equal(got, take(want[k][sp["full"]], sp)):
                                bad.append(f"rank {r['rank']} {name} {k}")
        groups = {(oi, tuple(o["data_parallel_group"])) for r in cfg["ranks"] for oi, o in enumerate(r["optimizers"])}
        report[label] = dict(
            values_checked=n, mismatches=bad[:10], optimizer_groups_missing=sorted(map(str, groups - seen))
        )

    # legacy
    it = os.path.join(out, "ckpt_legacy", f"iter_{STEPS:07d}")
    if os.path.isdir(it):
        n, bad = 0, []
        for r in cfg["ranks"]:
            if r["edp_rank"] != 0:
                continue
            sd = torch.load(os.path.join(it, mp_dir(r, s), "model_optim_rng.pt"), weights_only=False)
            for p in r["params"]:
                n += 1
                if not np.array_equal(sd["model"][p["name"]].numpy(), take(want["param"][p["full"]], p)):
                    bad.append(f"rank {r['rank']} {p['name']}")
        report["legacy_model_optim_rng"] = dict(values_checked=n, mismatches=bad)
        files = {}

        def legacy_flat(r, oi, o, gi, b):
            if o["data_parallel_group"][0] != r["rank"]:  # the optimizer's DP rank 0 writes its state
                return None
            path = os.path.join(it, mp_dir(r, s), "distrib_optim.pt")
            if path not in files:
                files[path] = torch.load(path, weights_only=False)
            st = files[path]
            st = st[oi] if isinstance(st, list) else st  # a ChainedOptimizer of several writes a list
            return st[gi][f32]

        flat_checks(legacy_flat, "legacy_distrib_optim")

    # torch_dist
    for stype in ("dp_reshardable", "fully_reshardable"):
        d = os.path.join(out, f"ckpt_torch_dist_{stype}")
        if not os.path.isdir(d):
            continue
        sd = read_dcp(d)
        n, bad = 0, []
        prefixes = {"": "param"} | ({f"optimizer.state.{k}.": k for k in kinds} if stype == "fully_reshardable" else {})
        for pfx, k in prefixes.items():
            for name in shapes:
                key, idx = dist_key(name)
                n += 1
                if not np.array_equal(sd[pfx + key].numpy()[idx], want[k][name]):
                    bad.append(pfx + name)
        report[f"torch_dist_{stype}_model_space"] = dict(values_checked=n, mismatches=bad)
        if stype == "dp_reshardable":
            n_opt = len(cfg["ranks"][0]["optimizers"])

            def dcp_flat(r, oi, o, gi, b, sd=sd, n_opt=n_opt):
                pfx = (
                    f"chained_{oi}." if n_opt > 1 else ""
                ) + f"optimizer.distributed.dp_group_idx_{o['data_parallel_group_idx']}"
                dt = "dtype_(torch.float32, torch.float32)"
                return {k: torch.cat([sd[f"{pfx}.gbuf_idx_{gi}.{dt}.bucket_idx_{bi}.{k}"]
                                      for bi in range(len(b["buckets"]))]) for k in kinds}  # fmt: skip

            flat_checks(dcp_flat, "torch_dist_dp_reshardable_flat")
    return report


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def do_run(root, run):
    import torch.multiprocessing as mp

    c = RUNS[run]
    out = os.path.join(root, run)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    init, tok, lab, mask = make_problem(c)
    np.savez(
        os.path.join(out, "problem.npz"),
        tokens=tok,
        labels=lab,
        loss_mask=mask,
        **{f"init/{k}": v for k, v in init.items()},
    )
    world = c["tp"] * c["pp"] * c["dp"]
    t0 = time.time()
    mp.start_processes(
        _entry, args=(world, free_port(), run, out, c, False), nprocs=world, join=True, start_method="spawn"
    )
    t1 = time.time()
    mp.start_processes(_entry, args=(1, free_port(), run, out, c, True), nprocs=1, join=True, start_method="spawn")
    t2 = time.time()
    inspect_checkpoints(out)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "trace.json")) as f:
        tr = json.load(f)
    with open(os.path.join(out, "reference_trace.json")) as f:
        rtr = json.load(f)
    ref = np.load(os.path.join(out, "reference.npz"))
    exp = np.load(os.path.join(out, "expected.npz"))

    def diff(k):
        return float(np.abs(exp[k] - ref[k]).max())

    summary["reference_tp1_pp1_ep1_dp1"] = dict(
        max_abs_loss_diff=max(abs(a["loss"] - b["loss"]) for a, b in zip(tr, rtr)),
        max_rel_grad_norm_diff=max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(tr, rtr)),
        max_abs_param_diff_step10=max(diff(k) for k in ref.files if k.startswith("params_step10/")),
        max_abs_param_diff_step15=max(diff(k) for k in ref.files if k.startswith("params_step15/")),
        largest_param_diffs_step10=sorted((diff(k), k) for k in ref.files if k.startswith("params_step10/"))[-4:],
        trace=[dict(step=t["step"], loss=t["loss"], grad_norm=t["grad_norm"]) for t in rtr],
    )  # fmt: skip
    summary["plain_torch_read_of_checkpoints_vs_expected"] = verify_checkpoints(out)
    from importlib.metadata import version

    import torch

    summary["seconds"] = dict(parallel_run=round(t1 - t0, 1), reference_run=round(t2 - t1, 1))
    summary["versions"] = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        megatron_core=version("megatron-core"),
        numpy=np.__version__,
    )
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for fn in ("problem.npz", "reference.npz", "reference_trace.json"):
        os.remove(os.path.join(out, fn))
    print(json.dumps({k: v for k, v in summary.items() if k != "reference_tp1_pp1_ep1_dp1"}, indent=1)[:6000])
    print(f"[{run}] {t2 - t0:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--variant", required=True, choices=sorted(VARIANT_RUNS))
    ap.add_argument("--only", help="one run of the variant (e.g. tp2pp2/tied)")
    args = ap.parse_args()
    try:
        import psutil  # noqa: F401
    except ImportError:
        sys.exit("psutil is required: megatron's torch_dist writer hangs without it")
    for run in VARIANT_RUNS[args.variant]:
        if args.only and run != args.only:
            continue
        do_run(os.path.abspath(args.out), run)


if __name__ == "__main__":
    main()
