"""Real Megatron-Core 0.16.1 continues jzero's export of a TP/PP/EP fixture: outside CI (it needs torch).

    python continue_from_jzero.py export OUT [--run tp2pp2/untied] [--format torch_dist]   # jzero's env (no torch)
    $PY continue_from_jzero.py megatron OUT [--run tp2pp2/untied] [--format torch_dist]    # the Megatron venv

`--format torch_dist` exports `--ckpt-format torch_dist --data-parallel-size <the fixture's dp>` (dp_reshardable)
into OUT/<run>/megatron_torch_dist and loads it as Megatron-LM loads torch_dist: the sharded state dict built
with the export's own `content_metadata`, `dist_checkpointing.load`, then the model's, the optimizer's and the
scheduler's `load_state_dict` (the fixture's `fix_step` after it: Megatron-Core 0.16.1's dp_reshardable load
resets torch-AdamW's step to 1); result in OUT/<run>/result_torch_dist.json.

`export` imports the run's Megatron step-10 checkpoint (`ckpt_legacy`) into jzero on a mesh of another
shape (`jzero ckpt import-megatron`, dp 8, flat ZeRO-2) and writes it back with `jzero ckpt export-megatron
--tensor-model-parallel-size ... --pipeline-model-parallel-size ... --expert-model-parallel-size ...` at the
sizes the fixture's run used, into OUT/<run>/megatron. `megatron` runs Megatron-Core on the fixture's ranks
(make_parallel_fixtures.py's model, DDP, DistributedOptimizer, schedules and CPU shims), loads each rank's
files from that export as Megatron-LM loads a legacy checkpoint (`load_state_dict` of the model, the
optimizer, `load_parameter_state`, the scheduler: its iteration, with the fixture's constant LR as
`--override-opt_param-scheduler` keeps it; the export describes jzero's cosine schedule), with the
torch-AdamW step workarounds of the fixture script, checks the loaded params against `expected.npz`'s
step-10 params, trains steps 11..15 on the fixture's batches and compares losses, grad norms and step-15
params with the fixture's own continuation (`trace.json`, `expected.npz`): OUT/<run>/result.json.
"""

import argparse
import datetime
import json
import os
import re
import sys
import traceback
import warnings
from functools import partial
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_parallel_fixtures as F  # noqa: E402

MODELS = {
    "tp2pp2/untied": {"tie_embeddings": False},
    "tp2pp2/tied": {"tie_embeddings": True},
    "moe_ep2": {"tie_embeddings": False, "n_layers": 2, "d_ff": 16,
                "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": None, "aux_loss_coef": 0.0}},
}  # fmt: skip


def export(out: Path, run: str, fmt: str = "torch") -> None:
    from jzero.cli import main

    c = F.RUNS[run]
    model = {"vocab_size": F.padded_vocab(c), "d_model": 16, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
             "d_ff": 32, "seq_len": 16, "mlp": "swiglu", "norm": "rmsnorm", "bias": False, "pos": "rope",
             **MODELS[run]}  # fmt: skip
    gb = c["mbs"] * c["nmb"] * c["dp"]
    cfg = {"model": model, "data": {"kind": "synthetic"}, "mesh": {"dp": 8},
           "zero": {"path": "flat", "strategy": "optim_grads"},
           "optimizer": {"lr": 0.01, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 0,
                         "clip_grad": c["clip_grad"]},
           "train": {"steps": 10**9, "global_batch": gb, "eval_every": 0}}  # fmt: skip
    d = out / run
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(json.dumps(cfg))
    sizes = ["--tensor-model-parallel-size", str(c["tp"]), "--pipeline-model-parallel-size", str(c["pp"]),
             "--expert-model-parallel-size", str(c["ep"])]  # fmt: skip
    if fmt == "torch_dist":
        sizes += ["--ckpt-format", "torch_dist", "--data-parallel-size", str(c["dp"])]
    target = d / ("megatron" if fmt == "torch" else "megatron_torch_dist")
    if not (d / "jzero").exists():
        assert main(["ckpt", "import-megatron", str(HERE / run / "ckpt_legacy"), str(d / "jzero"),
                     str(d / "config.yaml")]) == 0  # fmt: skip
    assert main(["ckpt", "export-megatron", str(d / "jzero"), str(target), str(d / "config.yaml"), *sizes]) == 0


def worker(rank, world, port, run, out, fmt="torch"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    F.cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = F.RUNS[run]
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    tp, pp, ep = c["tp"], c["pp"], c["ep"]
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    dp = ps.get_data_parallel_world_size()
    tp_rank, pp_rank, dp_rank = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                 ps.get_data_parallel_rank())  # fmt: skip
    ep_rank = ps.get_expert_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    mbs, nmb = c["mbs"], c["nmb"]
    exp = np.load(HERE / run / "expected.npz")
    want = json.loads((HERE / run / "trace.json").read_text())
    TOK, LAB, MASK = exp["tokens"], exp["labels"], exp["loss_mask"]
    V, shapes = F.padded_vocab(c), F.full_shapes(c)
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
    spec = get_gpt_layer_local_spec(num_experts=c.get("experts") if c["moe"] else None, moe_grouped_gemm=False,
                                    normalization="RMSNorm")  # fmt: skip
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True, bucket_size=None)  # fmt: skip
    # betas and eps unlike the run's: Megatron's loader must take them from jzero's param groups
    opt_config = OptimizerConfig(optimizer="adam", lr=F.HP["lr"], min_lr=0.0, weight_decay=F.HP["weight_decay"],
                                 adam_beta1=0.5, adam_beta2=0.5, adam_eps=1.0, clip_grad=c["clip_grad"], bf16=False,
                                 fp16=False, use_distributed_optimizer=True)  # fmt: skip
    gb = mbs * nmb * dp
    inner = GPTModel(config, spec, vocab_size=V, max_sequence_length=c["seq"], pre_process=first, post_process=last,
                     share_embeddings_and_output_weights=c["tied"], position_embedding_type="rope")  # fmt: skip
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner)
    opt = get_megatron_optimizer(opt_config, [model])
    sched = OptimizerParamScheduler(
        opt, init_lr=F.HP["lr"], max_lr=F.HP["lr"], min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10**6,
        lr_decay_style="constant", start_wd=F.HP["weight_decay"], end_wd=F.HP["weight_decay"],
        wd_incr_steps=10**6, wd_incr_style="constant", override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )  # fmt: skip
    dopts = list(opt.chained_optimizers) if hasattr(opt, "chained_optimizers") else [opt]

    # which slice of which whole param each local param is (make_parallel_fixtures.worker's local_spec)
    sps = {}
    for lname, p in inner.named_parameters():
        fname = lname
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", lname)
        if m:
            li, rest = int(m[1]), m[2]
            m2 = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)", rest)
            if m2:
                rest = (
                    f"mlp.experts.local_experts.{inner.decoder.layers[li].mlp.local_expert_indices[int(m2[1])]}.{m2[2]}"
                )
            fname = f"decoder.layers.{inner.decoder.layers[li].layer_number - 1}.{rest}"
        if c["tied"] and lname == "output_layer.weight":
            fname = "embedding.word_embeddings.weight"
        if getattr(p, "tensor_model_parallel", False) and tp > 1 and ".experts." not in lname:
            kind = "glu" if lname.endswith("linear_fc1.weight") else "split"
            sps[lname] = dict(full=fname, kind=kind, dim=int(p.partition_dim), index=tp_rank, parts=tp)
        else:
            sps[lname] = dict(full=fname, kind="replicated")

    # load as Megatron-LM loads a legacy checkpoint (checkpointing.load_checkpoint), with the fixtures'
    # torch-AdamW step workarounds (README: KeyError('step'), one step tensor shared after a load)
    mp_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing

        folder = Path(out) / run / "megatron_torch_dist" / f"iter_{F.STEPS:07d}"
        common = dist_checkpointing.load_common_state_dict(str(folder))
        md = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common),
                  dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))  # fmt: skip
        with torch.no_grad():
            for d in dopts:
                d._init_optimizer_states_with_dummy_values()
        model_sd = inner.sharded_state_dict(metadata=md)
        opt_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=md)
        sd = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, str(folder))
        with torch.no_grad():
            model.load_state_dict(sd["model"], strict=True)
            opt.load_state_dict(sd["optimizer"])
    else:
        folder = Path(out) / run / "megatron" / f"iter_{F.STEPS:07d}" / mp_dir
        sd = torch.load(folder / "model_optim_rng.pt", weights_only=True)
        for d in dopts:
            orig = d._set_main_param_and_optimizer_states

            def wrapped(model_param, tensors, d=d, orig=orig):
                gi, go = d.model_param_group_index_map[model_param]
                st = d.optimizer.state[d.optimizer.param_groups[gi]["params"][go]]
                if "step" in st and "step" not in tensors:
                    tensors = dict(tensors, step=st["step"].clone())
                return orig(model_param, tensors)

            d._set_main_param_and_optimizer_states = wrapped
        with torch.no_grad():
            model.load_state_dict(sd["model"], strict=True)
            opt.load_state_dict(sd["optimizer"])
            opt.load_parameter_state(str(folder / "distrib_optim.pt"))
    sched.load_state_dict(sd["opt_param_scheduler"])
    for d in dopts:
        for g in d.optimizer.param_groups:
            for p in g["params"]:
                if "step" in d.optimizer.state[p]:
                    d.optimizer.state[p]["step"] = torch.tensor(float(g["step"]), dtype=torch.float32)
    loaded = [(g["betas"], g["eps"], g["step"]) for d in dopts for g in d.optimizer.param_groups]
    bad10 = [n for n, p in inner.named_parameters()
             if not np.array_equal(p.detach().numpy(), F.take(exp[f"params_step10/{sps[n]['full']}"],
                                                              sps[n]))]  # fmt: skip

    fwd_bwd = get_forward_backward_func()

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])}

    def forward_step(data, m):
        b = next(data)
        return m(b["tokens"], b["position_ids"], attention_mask=None, labels=b["labels"]), partial(
            loss_func, b["loss_mask"]
        )

    def batches(step):
        res = []
        for mb in range(nmb):
            rows = slice(mb * mbs * dp + dp_rank * mbs, mb * mbs * dp + (dp_rank + 1) * mbs)
            res.append(dict(tokens=torch.from_numpy(TOK[step, rows].copy()),
                            labels=torch.from_numpy(LAB[step, rows].copy()),
                            loss_mask=torch.from_numpy(MASK[step, rows].copy()),
                            position_ids=torch.arange(c["seq"]).expand(mbs, c["seq"]).contiguous()))  # fmt: skip
        return res

    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    trace = []
    for step in range(F.STEPS, F.STEPS + F.CONT):
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = fwd_bwd(forward_step_func=forward_step, data_iterator=iter(batches(step)), model=[model],
                         num_microbatches=nmb, seq_length=c["seq"], micro_batch_size=mbs,
                         forward_only=False)  # fmt: skip
        _, gnorm, _ = opt.step()
        sched.step(increment=gb)
        loss = None
        if last:
            val = torch.vstack([d["lm loss"].view(-1) for d in losses]).sum(dim=0)
            dist.all_reduce(val, group=ps.get_data_parallel_group())
            loss = float(val[0] / val[1])
        allv = [None] * world
        dist.all_gather_object(allv, loss)
        trace.append((next(v for v in allv if v is not None), float(gnorm)))
    pieces = [None] * world
    dist.all_gather_object(pieces, [(sps[n], p.detach().numpy().copy()) for n, p in inner.named_parameters()])
    bads = [None] * world
    dist.all_gather_object(bads, bad10)
    if rank == 0:
        p15, _ = F.assemble([x for r in pieces for x in r], shapes)
        ref = want[F.STEPS : F.STEPS + F.CONT]
        result = dict(
            run=run, format=fmt, ranks=world, tp=tp, pp=pp, ep=ep, dp=dp,
            loaded_params_equal_step10_bitwise=not any(bads),
            adam_betas_eps_step_as_loaded=loaded,
            losses=[t[0] for t in trace], megatron_losses=[r["loss"] for r in ref],
            losses_bitwise_equal=[t[0] for t in trace] == [r["loss"] for r in ref],
            grad_norms_bitwise_equal=[t[1] for t in trace] == [r["grad_norm"] for r in ref],
            max_rel_loss_diff=max(abs(t[0] - r["loss"]) / abs(r["loss"]) for t, r in zip(trace, ref)),
            max_rel_grad_norm_diff=max(abs(t[1] - r["grad_norm"]) / r["grad_norm"] for t, r in zip(trace, ref)),
            max_abs_param_diff_step15=max(float(np.abs(p15[n] - exp[f"params_step15/{n}"]).max()) for n in shapes),
        )  # fmt: skip
        name = "result.json" if fmt == "torch" else f"result_{fmt}.json"
        (Path(out) / run / name).write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank, world, port, run, out, fmt="torch"):
    try:
        worker(rank, world, port, run, out, fmt)
    except Exception:
        traceback.print_exc()
        raise


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("side", choices=("export", "megatron"))
    ap.add_argument("out")
    ap.add_argument("--run", default="tp2pp2/untied", choices=sorted(F.RUNS))
    ap.add_argument("--format", default="torch", choices=("torch", "torch_dist"))
    args = ap.parse_args()
    out = Path(args.out).resolve()
    if args.side == "export":
        export(out, args.run, args.format)
        return
    import torch.multiprocessing as mp

    c = F.RUNS[args.run]
    world = c["tp"] * c["pp"] * c["dp"]
    mp.start_processes(_entry, args=(world, F.free_port(), args.run, str(out), args.format), nprocs=world, join=True,
                       start_method="spawn")  # fmt: skip


if __name__ == "__main__":
    main()
