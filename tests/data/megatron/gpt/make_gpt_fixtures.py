"""Writes the GPT fixtures in this folder with NVIDIA's Megatron-Core (not run by the tests).

Needs torch and megatron-core 0.16.1 (Python 3.11; no GPU): the fixtures' README in the parent folder
names the versions. Run from this folder:  python make_gpt_fixtures.py

- `llama/`: Megatron's GPTModel, local layer spec, LLaMA-style (RMSNorm, SwiGLU, grouped-query
  attention, rope, untied output layer, no biases), trained 2 steps by Megatron's
  DistributedDataParallel + DistributedOptimizer (ZeRO-1, torch AdamW) on 2 gloo ranks with
  2 buckets; its legacy checkpoint (`ckpt_legacy/`) and torch_dist dp_reshardable one
  (`ckpt_torch_dist/`, whose layer tensors are stacked [L, ...]), and `expected.npz`: the params after
  the 2 steps by name (`param/<name>`), tokens and Megatron's logits for them (eval, no dropout).
- `gpt2/`: GPT-2-style (LayerNorm, GELU (tanh), biases, learned positions, tied embeddings),
  untrained (random weights, every bias and norm nonzero except the QKV bias, which jzero's model
  has not): `model.pt` (its state dict, as the legacy file holds it) and `expected.npz` (tokens,
  logits).

A TorchFunctionMode sends Megatron's `cuda` tensors to the CPU (its optimizer dispatches on
`Tensor.type()`, which the mode reports as `torch.cuda.*`); the RNG tracker's fork is a no-op (no
dropout).
"""

import contextlib
import os
import shutil
import socket
import sys
import warnings
from functools import partial

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20251124
SHAPES = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24)
VOCAB, SEQ, BATCH = 32, 8, 4


def cpu_shims():
    import torch
    from torch.overrides import TorchFunctionMode

    def is_cuda(d):
        if isinstance(d, bool):
            return False
        return isinstance(d, int) or (isinstance(d, str) and d.startswith("cuda")) or (
            isinstance(d, torch.device) and d.type == "cuda"
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

    CudaToCpu().__enter__()
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()


def gpt(kind: str):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = kind == "llama"
    norm = "RMSNorm" if llama else "LayerNorm"
    config = TransformerConfig(
        **SHAPES, num_query_groups=2 if llama else 4, add_bias_linear=not llama, normalization=norm,
        gated_linear_unit=llama, activation_func=torch.nn.functional.silu if llama else partial(
            torch.nn.functional.gelu, approximate="tanh"),
        layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        perform_initialization=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_activation_fusion=False,
    )  # fmt: skip
    model = GPTModel(
        config, get_gpt_layer_local_spec(normalization=norm), vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope" if llama else "learned_absolute", share_embeddings_and_output_weights=not llama,
    )  # fmt: skip
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_qkv.bias"):
                p.zero_()
            elif p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return config, model


def tokens():
    return np.random.default_rng(SEED).integers(0, VOCAB, (3, BATCH, SEQ + 1))


def logits_of(model, toks):
    import torch

    model.eval()
    x = torch.from_numpy(toks[:, :-1].copy()).long()
    with torch.no_grad():
        return model(x, torch.arange(SEQ).expand_as(x), attention_mask=None).float().numpy()


def train_llama(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    cpu_shims()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    config, inner = gpt("llama")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=2000
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                        clip_grad=1.0, use_distributed_optimizer=True),
        [model],
    )  # fmt: skip
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=BATCH, lr_decay_steps=100 * BATCH,
        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=100 * BATCH, wd_incr_style="constant",
    )  # fmt: skip
    config.grad_scale_func, config.finalize_model_grads_func = opt.scale_loss, finalize_model_grads
    config.no_sync_func = model.no_sync
    toks = tokens()
    mb = BATCH // world

    def forward_step(data, m):
        t = next(data)
        x, y = t[:, :-1], t[:, 1:]
        loss = m(x, torch.arange(SEQ).expand_as(x), attention_mask=None, labels=y)
        return loss, lambda out: (out.sum(), torch.tensor(out.numel(), dtype=torch.int), {"loss": out.sum().detach()})

    for step in range(2):
        rows = torch.from_numpy(toks[step, rank * mb : (rank + 1) * mb].copy()).long()
        model.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([rows]), model=[model], num_microbatches=1,
            seq_length=SEQ, micro_batch_size=mb, forward_only=False,
        )  # fmt: skip
        opt.step()
        sched.step(increment=BATCH)
    out = os.path.join(HERE, "llama")
    legacy = os.path.join(out, "ckpt_legacy", "iter_0000002", "mp_rank_00")
    if rank == 0:
        os.makedirs(legacy, exist_ok=True)
    dist.barrier()
    opt.save_parameter_state(os.path.join(legacy, "distrib_optim.pt"))
    if rank == 0:
        sd = {"args": None, "checkpoint_version": 3.0, "iteration": 2, "model": inner.state_dict_for_save_checkpoint(),
              "optimizer": opt.state_dict(), "opt_param_scheduler": sched.state_dict()}  # fmt: skip
        torch.save(sd, os.path.join(legacy, "model_optim_rng.pt"))
        with open(os.path.join(out, "ckpt_legacy", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    dist.barrier()
    if rank == 0:
        os.makedirs(os.path.join(out, "ckpt_torch_dist"))
    dist.barrier()
    cwd = os.getcwd()
    os.chdir(out)  # DCP records the path it saves to: a relative one keeps machine paths out
    torch.use_deterministic_algorithms(True)  # the gaps between params, written from torch.empty, are NaN
    model_sd = inner.sharded_state_dict()
    opt_sd = opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    state = {"model": model_sd, "optimizer": opt_sd, "opt_param_scheduler": sched.state_dict(), "iteration": 2,
             "checkpoint_version": 3.0}  # fmt: skip
    dist_checkpointing.save(state, "ckpt_torch_dist")
    torch.use_deterministic_algorithms(False)
    os.chdir(cwd)
    if rank == 0:
        params = {f"param/{n}": p.detach().float().numpy() for n, p in inner.named_parameters()}
        logits = logits_of(inner, toks[2])
        np.savez_compressed(os.path.join(out, "expected.npz"), tokens=toks[2], logits=logits, **params)
    dist.barrier()
    dist.destroy_process_group()


def gpt2():
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    _, model = gpt("gpt2")
    out = os.path.join(HERE, "gpt2")
    os.makedirs(out, exist_ok=True)
    torch.save(model.state_dict_for_save_checkpoint(), os.path.join(out, "model.pt"))
    toks = tokens()[2]
    np.savez_compressed(os.path.join(out, "expected.npz"), tokens=toks, logits=logits_of(model, toks))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    for folder in ("llama", "gpt2"):
        shutil.rmtree(os.path.join(HERE, folder), ignore_errors=True)
    mp.spawn(train_llama, args=(2, free_port()), nprocs=2, join=True)
    gpt2()
    sys.exit(0)
