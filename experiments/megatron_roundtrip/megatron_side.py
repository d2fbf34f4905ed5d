"""Megatron's side of run.py: each of jzero's exports loaded into real Megatron-Core 0.16.1 and trained 5
steps (4 gloo ranks, the fixtures' MLP, DDP and DistributedOptimizer as the fixtures were made).

Run with torch and megatron-core installed:  python megatron_side.py OUT
Megatron's optimizer is built with wrong betas and eps on purpose: its loader must take them from the
file's param groups. Its torch-AdamW fallback needs the fixtures' two workarounds to resume: it raises
KeyError('step') loading distrib_optim.pt (the step is kept), and shares one step tensor across params
after a load (each gets its own).
"""

import json
import os
import socket
import sys
import warnings
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "data" / "megatron"
sys.path.insert(0, str(FIXTURES / "gpt"))
from make_gpt_fixtures import cpu_shims  # noqa: E402

SHAPES = {"fc1": (53, 37), "fc2": (37, 11), "fc3": (11, 53)}
VARIANTS = {"single_bucket": (False, None), "bucket1000": (True, 1000)}  # overlap_grad_reduce, bucket_size


def worker(rank, world, port, ckpt, variant, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    overlap, bucket_size = VARIANTS[variant]
    config = TransformerConfig(num_layers=1, hidden_size=37, num_attention_heads=1, use_cpu_initialization=True,
                               perform_initialization=False)  # fmt: skip

    class Scale(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * self.weight

    class TinyModel(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.fc1, self.scale = torch.nn.Linear(53, 37), Scale(37)
            self.fc2, self.fc3 = torch.nn.Linear(37, 11), torch.nn.Linear(11, 53, bias=False)

        def set_input_tensor(self, t):
            pass

        def forward(self, x):
            return self.fc3(torch.tanh(self.fc2(self.scale(torch.tanh(self.fc1(x))))))

    inner = TinyModel()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                               use_distributed_optimizer=True, bucket_size=bucket_size)  # fmt: skip
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.5,
                                                 adam_beta2=0.5, adam_eps=1.0, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [model])  # fmt: skip
    sched = OptimizerParamScheduler(opt, init_lr=1e-2, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=0,
                                    lr_decay_steps=10**6, lr_decay_style="constant", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10**6, wd_incr_style="constant")  # fmt: skip
    dopt = opt.chained_optimizers[0]
    set_states = dopt._set_main_param_and_optimizer_states

    def keep_step(model_param, tensors):
        gi, go = dopt.model_param_group_index_map[model_param]
        state = dopt.optimizer.state[dopt.optimizer.param_groups[gi]["params"][go]]
        if "step" in state and "step" not in tensors:
            tensors = dict(tensors, step=state["step"].clone())
        return set_states(model_param, tensors)

    dopt._set_main_param_and_optimizer_states = keep_step
    iteration = int((Path(ckpt) / "latest_checkpointed_iteration.txt").read_text())
    folder = Path(ckpt) / f"iter_{iteration:07d}" / "mp_rank_00"
    sd = torch.load(folder / "model_optim_rng.pt", weights_only=True)
    with torch.no_grad():
        inner.load_state_dict(sd["model"], strict=True)
        opt.load_state_dict(sd["optimizer"])
        opt.load_parameter_state(str(folder / "distrib_optim.pt"))
    sched.load_state_dict(sd["opt_param_scheduler"])
    for group in dopt.optimizer.param_groups:
        for p in group["params"]:
            if "step" in dopt.optimizer.state[p]:
                dopt.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))
    groups = [[list(g["betas"]), g["eps"], g["step"]] for g in dopt.optimizer.param_groups]
    data = np.load(FIXTURES / "inputs.npz")
    x_all, t_all = data["x"], data["t"]
    mb = x_all.shape[1] // world
    config.grad_scale_func, config.finalize_model_grads_func = opt.scale_loss, finalize_model_grads
    config.no_sync_func = model.no_sync if overlap else None

    def loss_func(t, out):
        se = (out - t) ** 2
        report = torch.cat([se.sum().detach().view(1), torch.tensor([float(se.numel())])])
        return se.sum(), torch.tensor(se.numel(), dtype=torch.int), {"mse": report}

    def forward_step(data_iterator, m):
        x, t = next(data_iterator)
        return m(x), partial(loss_func, t)

    steps = []
    for step in range(iteration, iteration + 5):
        rows = slice(rank * mb, (rank + 1) * mb)
        batch = (torch.from_numpy(x_all[step, rows].copy()), torch.from_numpy(t_all[step, rows].copy()))
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
            seq_length=1, micro_batch_size=mb, decoder_seq_length=1, forward_only=False,
        )  # fmt: skip
        _, norm, _ = opt.step()
        sched.step(increment=x_all.shape[1])
        total = torch.vstack([d["mse"].view(-1) for d in losses]).sum(0)
        dist.all_reduce(total)
        steps.append({"step": step + 1, "loss": float(total[0] / total[1]), "grad_norm": float(norm)})
    if rank == 0:
        params = {n: p.detach().numpy().tolist() for n, p in inner.named_parameters()}
        Path(out).write_text(json.dumps({"trace": steps, "groups": groups, "params": params}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    out = Path(sys.argv[1])
    for variant in VARIANTS:
        for run in ("a", "b"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            args = (4, port, str(out / variant / run), variant, str(out / variant / f"{run}_megatron.json"))
            mp.spawn(worker, args=args, nprocs=4, join=True)
            print(f"{variant} {run}: continued in Megatron")
