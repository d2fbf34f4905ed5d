"""jzero's state written as Megatron-Core 0.16.1's legacy checkpoint for a receiving run's tensor, pipeline and
expert model-parallel sizes (`megatron.save(..., parallel=)`, `jzero ckpt export-megatron
--tensor-model-parallel-size ...`), against Megatron's own TP 2 x PP 2 (untied, tied) and EP 2 MoE files
(tests/data/megatron/gpt/tp2pp2, moe_ep2; their README section "Tensor/pipeline-parallel and MoE GPTs").

Megatron's step-10 checkpoint imported into jzero and exported at the sizes that wrote it gives Megatron's
own files back, bit for bit: per model-parallel rank, its model state dict (local names, order, slices,
`_extra_state`), the distributed optimizer's buffers (bucket order, 64-alignment, the tied embedding's
copy in its own bucket on the last stage, a MoE model's [dense, experts] and [None, experts]), the
iteration, the scheduler and Megatron's param groups. Written at other sizes (TP 1 / 2, PP 1 / 2 / 4,
EP 1 / 4, with and without buckets) it reads back to the same whole model. Sizes that do not divide the
model are one line each. Everything here is exact: the split is reshapes and slices.
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from helpers import megatron_fixtures as fixtures
from jzero.config import from_dict
from jzero.interop import InteropError, megatron, torch_format
from jzero.interop.gpt import gpt_names, megatron_names
from jzero.interop.megatron_read import _param_groups
from jzero.interop.megatron_save import write

PARALLEL = fixtures.PARALLEL
CLIP = fixtures.PARALLEL_CLIP
GLOBAL_BATCH = fixtures.PARALLEL_GLOBAL_BATCH
GPT = fixtures.PARALLEL_GPT
MODELS = fixtures.PARALLEL_MODELS
STEP = fixtures.PARALLEL_STEP


def config(run: str, mesh: dict, path: str = "flat", strategy: str = "optim_grads"):
    return from_dict({
        "model": MODELS[run], "data": {"kind": "synthetic"}, "mesh": mesh,
        "zero": {"path": path, "strategy": strategy},
        "optimizer": {"lr": 1e-2, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "warmup_steps": 0,
                      "clip_grad": CLIP[run]},
        "train": {"steps": 10**9, "global_batch": GLOBAL_BATCH[run], "eval_every": 0},
    })  # fmt: skip


def hyperparams(run: str) -> megatron.Hyperparams:
    """The fixtures' AdamW and constant LR schedule (their scheduler: 10**6 samples of decay)."""
    gb = GLOBAL_BATCH[run]
    return megatron.Hyperparams(lr=1e-2, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, min_lr=0.0,
                                decay_iters=10**6 // gb, decay_style="constant", global_batch=gb)  # fmt: skip


def order(run: str) -> list[str]:
    """Megatron's registration order of the whole model (with `_extra_state` keys)."""
    return list(megatron_names(config(run, {"dp": 8}).model))


@functools.cache
def imported(run: str) -> megatron.MegatronCheckpoint:
    return megatron.read(GPT / run / "ckpt_legacy")


def theirs(run: str):
    return GPT / run / "ckpt_legacy" / f"iter_{STEP:07d}"


def assert_same(a, b, where: str) -> None:
    """`a` equals `b` exactly: containers (dict key order included), arrays (dtype, shape, bits), scalars."""
    if isinstance(b, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in b:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a!r}"
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def assert_megatrons_files(run: str, folder, groups_exact: bool) -> None:
    """The export in `folder` (iter_N) holds Megatron's own files of `run`: the same rank folders, each rank's
    model state dict and `distrib_optim.pt` bit for bit, the iteration and scheduler; Megatron's param groups
    are among the export's (exactly them where `groups_exact`)."""
    want = theirs(run)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in want.iterdir())
    for rank in sorted(want.iterdir()):
        a = torch_format.load(folder / rank.name / megatron.MODEL_FILE)
        b = torch_format.load(rank / megatron.MODEL_FILE)
        assert_same(a["model"], b["model"], f"{rank.name} model")
        assert a["iteration"] == b["iteration"] == STEP and a["checkpoint_version"] == b["checkpoint_version"]
        assert_same(a["opt_param_scheduler"], b["opt_param_scheduler"], f"{rank.name} scheduler")
        ours, megatrons = (_param_groups(x["optimizer"], rank.name) for x in (a, b))
        if groups_exact:
            assert_same(ours, megatrons, f"{rank.name} param groups")
        else:
            assert all(g in ours for g in megatrons), f"{rank.name}: {megatrons} not among {ours}"
        assert isinstance(a["optimizer"], list) == isinstance(b["optimizer"], list)
        optim = torch_format.load(folder / rank.name / megatron.OPTIM_FILE)
        assert_same(optim, torch_format.load(rank / megatron.OPTIM_FILE), f"{rank.name} distrib_optim")


def assert_reads_as_megatrons(ck: megatron.MegatronCheckpoint, run: str, parallel) -> None:
    want = imported(run)
    assert ck.parallel == tuple(parallel) and ck.iteration == STEP
    for key in ("model", "main", "exp_avg", "exp_avg_sq"):
        assert list(getattr(ck, key)) == list(getattr(want, key)), key
        for name, x in getattr(want, key).items():
            np.testing.assert_array_equal(getattr(ck, key)[name], x, err_msg=f"{key} {name}")


# ---------------------------------------------------------------- model space: Megatron's files back


def write_ck(run: str, out, parallel, bucket_size=None):
    ck = imported(run)
    return write(out, iteration=ck.iteration, model=ck.model, main=ck.main, exp_avg=ck.exp_avg,
                 exp_avg_sq=ck.exp_avg_sq, order=order(run), param_groups=ck.param_groups[:2],
                 scheduler=ck.scheduler, bucket_size=bucket_size, parallel=parallel,
                 query_groups=MODELS[run]["n_kv_heads"])  # fmt: skip


@pytest.mark.parametrize("run", list(MODELS))
def test_write_gives_megatrons_own_files(run, tmp_path):
    """Megatron's checkpoint read to the whole model and written at the sizes that wrote it: its own files."""
    folder = write_ck(run, tmp_path, PARALLEL[run])
    assert (tmp_path / megatron.TRACKER).read_text() == str(STEP)
    assert_megatrons_files(run, folder, groups_exact=False)


SIZES = [  # (run, (tp, pp, ep), --ddp-bucket-size)
    ("tp2pp2/untied", (1, 1, 1), None), ("tp2pp2/untied", (2, 1, 1), 700), ("tp2pp2/untied", (1, 2, 1), None),
    ("tp2pp2/untied", (2, 4, 1), 700), ("tp2pp2/untied", (1, 4, 1), 700),
    ("tp2pp2/tied", (1, 1, 1), None), ("tp2pp2/tied", (1, 2, 1), 700), ("tp2pp2/tied", (2, 4, 1), None),
    ("moe_ep2", (1, 1, 1), None), ("moe_ep2", (1, 1, 4), 700), ("moe_ep2", (1, 2, 2), None),
    ("moe_ep2", (1, 2, 4), 700),
]  # fmt: skip


@pytest.mark.parametrize("run, parallel, bucket_size", SIZES)
def test_write_at_other_sizes_reads_back(run, parallel, bucket_size, tmp_path):
    """Written for other model-parallel sizes and bucket sizes (Megatron's DDP buckets only the first pipeline
    stage), the files read back to the same whole model, weights and optimizer state bit for bit."""
    folder = write_ck(run, tmp_path, parallel, bucket_size)
    tp, pp, ep = parallel
    assert len(list(folder.iterdir())) == tp * pp * ep
    names = [n for n in order(run) if not n.endswith(megatron.EXTRA_STATE)]
    assert_reads_as_megatrons(megatron.read(tmp_path, bucket_size=bucket_size, names=names), run, parallel)
    if run == "tp2pp2/tied" and pp > 1:  # both copies of the embedding, the last stage's in a bucket of its own
        last = torch_format.load(folder / f"mp_rank_00_{pp - 1:03d}" / megatron.MODEL_FILE)["model"]
        first = torch_format.load(folder / "mp_rank_00_000" / megatron.MODEL_FILE)["model"]
        np.testing.assert_array_equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
        assert list(last)[-2:] == ["output_layer.weight", "output_layer._extra_state"]


# ---------------------------------------------------------------- through jzero: import, export


def jzero_state(run: str, mesh: dict, path: str = "flat"):
    from jzero.train.loop import setup

    cfg = config(run, mesh, path)
    devices = jax.devices()[: int(np.prod(list(mesh.values())))]
    r = setup(cfg, devices, with_data=False)
    names, key_order = gpt_names(r.model.abstract_params(), megatron_names(r.cfg.model))
    return r, names, key_order, megatron.load(GPT / run / "ckpt_legacy", r.zero, names)


ROUND_TRIPS = [
    ("tp2pp2/untied", {"dp": 2, "tp": 2}, "flat"),
    ("tp2pp2/tied", {"dp": 8}, "spec"),
    ("moe_ep2", {"dp": 4, "ep": 2}, "flat"),
]


@pytest.mark.parametrize("run, mesh, path", ROUND_TRIPS)
def test_jzero_export_is_megatrons_checkpoint(run, mesh, path, tmp_path):
    """Megatron's step-10 checkpoint imported into a jzero mesh of another shape and exported at Megatron's
    sizes: Megatron's own files, param groups included; and the export imports back to the same state.
    Exported at TP 1 PP 1 (EP 1), it reads to the same whole model."""
    r, names, key_order, state = jzero_state(run, mesh, path)
    m = r.cfg.model
    kwargs = dict(hyperparams=hyperparams(run), order=key_order, query_groups=m.n_kv_heads)
    folder = megatron.save(tmp_path / "same", state, r.zero, names, parallel=PARALLEL[run], **kwargs)
    assert_megatrons_files(run, folder, groups_exact=run != "moe_ep2")  # MoE: an extra expert group (wd_mult 0)
    back = megatron.load(tmp_path / "same", r.zero, names)
    for a, b in zip(jax.tree.leaves(jax.device_get(back)), jax.tree.leaves(jax.device_get(state))):
        np.testing.assert_array_equal(a, b)
    megatron.save(tmp_path / "one", state, r.zero, names, **kwargs)
    assert_reads_as_megatrons(megatron.read(tmp_path / "one"), run, (1, 1, 1))
    # torch_dist (dp_reshardable) from the same jzero state reads back to Megatron's whole model as well
    megatron.save(tmp_path / "td", state, r.zero, names, parallel=PARALLEL[run], ckpt_format="torch_dist",
                  data_parallel=4, **kwargs)  # fmt: skip
    assert_reads_as_megatrons(megatron.read(tmp_path / "td", names=list(key_order)), run, PARALLEL[run])


@pytest.mark.slow
def test_cli_exports_for_megatrons_sizes(tmp_path, capsys):
    """`jzero ckpt import-megatron` then `export-megatron --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2` (and the MoE's `--expert-model-parallel-size 2`): Megatron's own
    tensors per rank, and the flags that say so."""
    from jzero.cli import main

    for run in ("tp2pp2/untied", "moe_ep2"):
        cfg = tmp_path / f"{run.replace('/', '_')}.yaml"
        cfg.write_text(json.dumps({
            "model": MODELS[run], "data": {"kind": "synthetic"}, "zero": {"path": "flat", "strategy": "optim_grads"},
            "optimizer": {"lr": 0.01, "b2": 0.95, "warmup_steps": 0, "clip_grad": CLIP[run]},
            "train": {"steps": 20, "global_batch": GLOBAL_BATCH[run], "eval_every": 0},
        }))  # fmt: skip
        j, m = tmp_path / f"j_{run.replace('/', '_')}", tmp_path / f"m_{run.replace('/', '_')}"
        assert main(["ckpt", "import-megatron", str(GPT / run / "ckpt_legacy"), str(j), str(cfg)]) == 0
        tp, pp, ep = PARALLEL[run]
        sizes = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                 "--expert-model-parallel-size", str(ep)]  # fmt: skip
        capsys.readouterr()
        assert main(["ckpt", "export-megatron", str(j), str(m), str(cfg), *sizes]) == 0
        out = capsys.readouterr().out
        assert f"{tp * pp * ep} model-parallel ranks (tp {tp}, pp {pp}, ep {ep})" in out, out
        if run == "moe_ep2":
            assert "--expert-model-parallel-size 2" in out and "--num-experts 4 --moe-router-topk 2" in out, out
        else:
            assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in out, out
            assert "--make-vocab-size-divisible-by 32" in out, out
        folder = m / f"iter_{STEP:07d}"
        want = theirs(run)
        for rank in sorted(want.iterdir()):
            a = torch_format.load(folder / rank.name / megatron.MODEL_FILE)["model"]
            assert_same(a, torch_format.load(rank / megatron.MODEL_FILE)["model"], rank.name)
            optim = torch_format.load(folder / rank.name / megatron.OPTIM_FILE)
            assert_same(optim, torch_format.load(rank / megatron.OPTIM_FILE), rank.name)


# ---------------------------------------------------------------- bad input: one line each


def refused(fn, *fragments):
    with pytest.raises(InteropError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg


def test_sizes_that_do_not_divide_the_model_are_one_line(tmp_path):
    refused(lambda: write_ck("tp2pp2/untied", tmp_path / "a", (1, 3, 1)), "4 layers do not divide over 3 pipeline",
            "--pipeline-model-parallel-size")  # fmt: skip
    refused(lambda: write_ck("moe_ep2", tmp_path / "b", (1, 1, 3)), "4 experts do not divide over 3 expert-parallel",
            "--expert-model-parallel-size")  # fmt: skip
    refused(lambda: write_ck("tp2pp2/untied", tmp_path / "c", (1, 1, 2)), "expert parallelism 2", "a dense model")
    refused(lambda: write_ck("tp2pp2/untied", tmp_path / "d", (4, 1, 1)), "2 attention query groups",
            "do not divide over tensor parallelism 4", "--num-query-groups")  # fmt: skip
    refused(lambda: write_ck("tp2pp2/untied", tmp_path / "e", (3, 1, 1)), "padded vocabulary of 64",
            "tensor parallelism 3")  # fmt: skip
    refused(lambda: write_ck("moe_ep2", tmp_path / "f", (2, 1, 1)), "is an expert param", "expert-TP")
    refused(lambda: write_ck("tp2pp2/untied", tmp_path / "g", (0, 1, 1)), "tensor-model-parallel size 0")
    # the MLP's hidden units: a SwiGLU fc1 of 2 x 3 rows splits each half, 3 over 2 does not
    model = {"embedding.word_embeddings.weight": np.zeros((8, 4), np.float32),
             "decoder.layers.0.mlp.linear_fc1.weight": np.zeros((6, 4), np.float32),
             "decoder.layers.0.mlp.linear_fc2.weight": np.zeros((4, 3), np.float32)}  # fmt: skip
    refused(lambda: write(tmp_path / "h", iteration=1, model=model, main=model, exp_avg=model, exp_avg_sq=model,
                          order=list(model), param_groups=[], scheduler={}, parallel=(2, 1, 1)),
            "the MLP's 3 hidden units", "--ffn-hidden-size", "tensor parallelism 2")  # fmt: skip
    assert not any(tmp_path.iterdir())  # nothing written


def test_cli_export_flags_bad_input_is_one_line(tmp_path, capsys):
    from jzero.cli import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"model": MODELS["tp2pp2/untied"], "data": {"kind": "synthetic"}}))
    for flags, needle in (
        (["--ckpt-format", "torch_dist"], "--ckpt-format torch_dist needs --data-parallel-size N"),
        (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size 0 must be >= 1"),
    ):
        assert main(["ckpt", "export-megatron", str(tmp_path), str(tmp_path / "m"), str(cfg), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err  # fmt: skip
