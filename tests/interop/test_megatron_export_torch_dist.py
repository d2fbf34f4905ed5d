"""jzero's state written as Megatron-Core 0.16.1's torch_dist checkpoint with `dp_reshardable` optimizer state
(`megatron.write(..., ckpt_format="torch_dist", data_parallel=)`, `jzero ckpt export-megatron --ckpt-format
torch_dist --data-parallel-size N`), against Megatron's own TP 2 x PP 2 and EP 2 MoE torch_dist files
(tests/data/megatron/gpt/tp2pp2/untied, moe_ep2; their README's "Checkpoint formats").

Megatron's step-10 torch_dist checkpoint read into model space (and through a jzero mesh) and written at the
sizes and DP that wrote it holds Megatron's own tensors by key, bit for bit: the stacked model tensors under
TE's norm names, every model-parallel group's per-bucket vectors (NaN in the alignment gaps, as the fixtures'
deterministic Megatron writes them), the per-bucket sizes padded for DP, the param groups, the `_extra_state`
objects; the file layout differs (one `.distcp` file). jzero's reader reads it back to the same model. The
written `.metadata` is a DCP `Metadata` pickle with torch's classes (torch's own reader loads it: checked
outside CI, docs/megatron.md "What was checked").
"""

from __future__ import annotations

import functools
import json
import pickletools

import numpy as np
import pytest

from helpers import megatron_fixtures as fixtures
from jzero.config import from_dict
from jzero.interop import InteropError, megatron, torch_dist, torch_format
from jzero.interop.gpt import megatron_names
from jzero.interop.megatron_save import write

PARALLEL = fixtures.PARALLEL
GPT = fixtures.PARALLEL_GPT
MODELS = fixtures.PARALLEL_MODELS
STEP = fixtures.PARALLEL_STEP

DP = {"tp2pp2/untied": 2, "tp2pp2/tied": 2, "moe_ep2": 4}
DIST = "ckpt_torch_dist_dp_reshardable"


def order(run: str) -> list[str]:
    return list(megatron_names(from_dict({"model": MODELS[run], "data": {"kind": "synthetic"}}).model))


def param_names(run: str) -> list[str]:
    return [n for n in order(run) if not n.endswith(megatron.EXTRA_STATE)]


@functools.cache
def imported(run: str) -> megatron.MegatronCheckpoint:
    """Megatron's step-10 checkpoint in model space (torch_dist where the fixture has one; tied: legacy)."""
    source = GPT / run / (DIST if run != "tp2pp2/tied" else "ckpt_legacy")
    return megatron.read(source, names=param_names(run))


def write_dist(run: str, out, parallel=None, dp=None, bucket_size=None, **kwargs):
    ck = imported(run)
    return write(out, iteration=ck.iteration, model=ck.model, main=ck.main, exp_avg=ck.exp_avg,
                 exp_avg_sq=ck.exp_avg_sq, order=order(run), param_groups=ck.param_groups[:2], scheduler=ck.scheduler,
                 bucket_size=bucket_size, parallel=parallel or PARALLEL[run], query_groups=2, ckpt_format="torch_dist",
                 data_parallel=DP[run] if dp is None else dp, **kwargs)  # fmt: skip


def assert_reads_as(ck: megatron.MegatronCheckpoint, want: megatron.MegatronCheckpoint, parallel) -> None:
    assert ck.parallel == tuple(parallel) and ck.iteration == STEP and ck.format == "torch_dist (dp_reshardable)"
    for key in ("model", "main", "exp_avg", "exp_avg_sq"):
        assert list(getattr(ck, key)) == list(getattr(want, key)), key
        for name, x in getattr(want, key).items():
            y = getattr(ck, key)[name]
            assert y.dtype == x.dtype and y.shape == x.shape, f"{key} {name}"
            np.testing.assert_array_equal(y, x, err_msg=f"{key} {name}")


@pytest.mark.parametrize("run", ["tp2pp2/untied", "moe_ep2"])
def test_write_holds_megatrons_own_tensors(run, tmp_path):
    """Written at the sizes and DP that wrote the fixture: every key of Megatron's file, each tensor bit for bit
    (NaN gaps included), each object equal (a MoE's expert optimizer: Megatron's group among jzero's), the
    iteration, scheduler and sharding type in common.pt; and it reads back to the same model."""
    folder = write_dist(run, tmp_path)
    assert folder == tmp_path / f"iter_{STEP:07d}" and (tmp_path / megatron.TRACKER).read_text() == str(STEP)
    ours, theirs = torch_dist.TorchDist(folder), torch_dist.TorchDist(GPT / run / DIST)
    assert sorted(ours.keys) == sorted(theirs.keys)
    for key in theirs.keys:
        if theirs.is_tensor(key):
            a, b = ours.tensor(key), theirs.tensor(key)
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert np.array_equal(a, b, equal_nan=True), key
            assert np.array_equal(np.isnan(a), np.isnan(b)), key
        else:
            a, b = ours.object(key), theirs.object(key)
            if key.startswith("chained_1.") and key.endswith("optimizer/shard_0_1"):
                assert all(g in a[0]["param_groups"] for g in b[0]["param_groups"]), key
            else:
                assert repr(a) == repr(b), key
    for k in ("iteration", "checkpoint_version", "opt_param_scheduler", "optimizer"):
        assert ours.common[k] == theirs.common[k], k
    assert ours.common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    args = ours.common["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == PARALLEL[run][:2]
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert_reads_as(megatron.read(tmp_path, names=param_names(run)), imported(run), PARALLEL[run])


def test_metadata_is_torchs_pickle(tmp_path):
    """`.metadata` names torch.distributed.checkpoint's classes, as torch writes it (no jzero class inside)."""
    folder = write_dist("moe_ep2", tmp_path)
    data = (folder / ".metadata").read_bytes()
    names = {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    assert names == {
        "torch.distributed.checkpoint.metadata Metadata", "torch.distributed.checkpoint.metadata TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata TensorProperties", "torch.distributed.checkpoint.metadata "
        "_MEM_FORMAT_ENCODING", "torch.distributed.checkpoint.metadata ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata BytesStorageMetadata", "torch.distributed.checkpoint.metadata "
        "MetadataIndex", "torch.distributed.checkpoint.metadata StorageMeta", "torch.distributed.checkpoint.filesystem "
        "_StorageInfo", "torch Size", "torch float32", "torch.serialization _get_layout",
    }  # fmt: skip
    for path in folder.glob("*.distcp"):
        assert path.stat().st_size > 0
    assert isinstance(torch_format.load(folder / "common.pt")["args"], torch_format.Namespace)


SIZES = [  # (run, (tp, pp, ep), dp, --ddp-bucket-size)
    ("tp2pp2/untied", (1, 1, 1), 1, None), ("tp2pp2/untied", (2, 4, 1), 3, 700), ("tp2pp2/tied", (2, 2, 1), 2, None),
    ("tp2pp2/tied", (1, 4, 1), 4, 700), ("moe_ep2", (1, 1, 1), 2, None), ("moe_ep2", (1, 2, 4), 8, 700),
]  # fmt: skip


@pytest.mark.parametrize("run, parallel, dp, bucket_size", SIZES)
def test_write_at_other_sizes_reads_back(run, parallel, dp, bucket_size, tmp_path):
    """At other model-parallel, data-parallel and bucket sizes (a tied model's last-stage copy in a bucket of its
    own): the same model bit for bit, and the per-bucket sizes padded to a multiple of lcm(dp, 128)."""
    folder = write_dist(run, tmp_path, parallel, dp, bucket_size)
    assert_reads_as(megatron.read(tmp_path, names=param_names(run)), imported(run), parallel)
    td = torch_dist.TorchDist(folder)
    tp, pp, ep = parallel
    for key in td.keys:
        if key.endswith("per_bucket_numel/shard_0_1"):
            group_dp = dp // ep if key.startswith("chained_1.") else dp
            padded = next(iter(td.object(key)[0][0].values()))
            assert all(s % np.lcm(group_dp, 128) == 0 for s in padded), (key, padded)
    groups = [k for k in td.keys if k.endswith("per_bucket_numel/shard_0_1")]
    assert len(groups) == tp * pp + (ep * pp if run == "moe_ep2" else 0)


def test_bad_input_is_one_line(tmp_path):
    def refused(fn, *fragments):
        with pytest.raises(InteropError) as info:
            fn()
        msg = str(info.value)
        assert "\n" not in msg and all(f in msg for f in fragments), msg

    refused(lambda: write_dist("tp2pp2/untied", tmp_path / "a", dp=0), "data-parallel size", "--data-parallel-size")
    refused(lambda: write_dist("moe_ep2", tmp_path / "b", dp=3), "a multiple of the expert-parallel size 2")
    write_dist("tp2pp2/untied", tmp_path / "d")
    refused(lambda: write_dist("tp2pp2/untied", tmp_path / "d"), "exists", "never overwrites")
    # a model whose layers differ: torch_dist stacks them
    ck = imported("tp2pp2/untied")
    model = {k: v for k, v in ck.model.items() if k != "decoder.layers.3.mlp.linear_fc2.weight"}
    keys = [k for k in order("tp2pp2/untied") if k != "decoder.layers.3.mlp.linear_fc2.weight"]
    refused(lambda: write(tmp_path / "e", iteration=1, model=model, main=model, exp_avg=model, exp_avg_sq=model,
                          order=keys, param_groups=[], scheduler={}, ckpt_format="torch_dist", data_parallel=1),
            "torch_dist stacks the layers", "--ckpt-format torch")  # fmt: skip
    refused(lambda: write(tmp_path / "f", iteration=1, model=model, main=model, exp_avg=model, exp_avg_sq=model,
                          order=keys, param_groups=[], scheduler={}, ckpt_format="zarr"),
            "ckpt_format 'zarr'")  # fmt: skip
    assert not (tmp_path / "a").exists() and not (tmp_path / "e").exists()
