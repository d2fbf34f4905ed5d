"""jzero against real Megatron-Core 0.16.1 (tests/data/megatron): its flat layout, its first 10 steps,
its step-10 checkpoints read bit for bit in both formats, the 5 steps it trained after them continued
in jzero on both paths, ZeRO-1 and ZeRO-2, dp 4 and other dp sizes (and DDP and ZeRO-3), and jzero's
export read back.

Tolerances. jzero and Megatron compute the same float32 arithmetic in different orders, so they agree
to float rounding, not bitwise: the grads (XLA's dot products and reductions against torch's CPU
kernels) differ by up to 4.2e-7 of each tensor's largest grad (measured on these fixtures, steps
1..10), and AdamW rounds differently (optax's order against torch's single-tensor one:
`test_adamw_rounding_against_torch_order` bounds it by 1 ulp of the tensor's largest param per step).
Measured against Megatron, relative to each tensor's largest value: after steps 1..10 the params
within 4.5e-7, the owned exp_avg within 4.6e-7 and exp_avg_sq within 5.9e-7, the losses within
2.2e-7 and the grad norms within 2.5e-7 (relative); continuing steps 11..15 in the 48 ZeRO-1/2
configurations of `ALL`, params 2.5e-7, losses 2.9e-7, grad norms 1.7e-7. Megatron itself differs
from a plain torch restatement of the problem by 1.2e-7, 1e-7 and 7e-8. The bound below, 1e-6 of
each compared quantity's magnitude, is the fixtures' own guidance for a float32 reimplementation,
1.7x to 6x what is observed; a layout or ownership error moves a value by its own size.
"""

from __future__ import annotations

import builtins
import errno
import io
import math
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers.megatron_fixtures import (
    CHECKPOINT_STEP,
    FORMATS,
    HYPERPARAMS,
    NAMES,
    ORDER,
    VARIANTS,
    build,
    by_name,
    checkpoint,
    final_params,
    init_state,
    layout,
    rank_shards,
    trace,
    train,
)
from jzero.interop import InteropError, megatron

REL = 1e-6  # relative to each compared quantity's magnitude (module docstring)


def assert_close(got, want, what: str):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max()) / scale
    assert err <= REL, f"{what}: max |diff| {err:.3g} of its magnitude"


def assert_trace(losses, norms, steps: list[dict]):
    for key, got in (("loss_global_mean", losses), ("grad_norm", norms)):
        want = np.array([s[key] for s in steps])
        np.testing.assert_allclose(got, want, rtol=REL, atol=0, err_msg=key)


def owned(zero, buckets, rank: int) -> list[np.ndarray]:
    """Rank `rank`'s shard of each flat bucket array ([1, S_b])."""
    out = []
    for b, x in enumerate(buckets):
        x = np.asarray(jax.device_get(x))[0]
        size = zero.flat.shard_size(b)
        out.append(x[rank * size : (rank + 1) * size])
    return out


# ---------------------------------------------------------------- layout and training from init


@pytest.mark.parametrize("variant", VARIANTS)
def test_flat_layout_is_megatrons(variant):
    zero = build(variant, registration_order=True)
    lay = zero.flat.buffers[0].layout
    want = layout(variant)["buffer"]
    assert lay.numel == want["numel"]
    assert [list(b) for b in lay.bucket_indices] == want["bucket_indices"]
    assert list(lay.per_bucket_numel_unpadded) == [b["numel_unpadded"] for b in want["buckets"]]
    for i, name in enumerate(ORDER):
        start, end, bucket = lay.param_index_map[i]
        assert want["param_index_map"][name] == {"start": start, "end": end, "bucket_id": bucket}
    for rank, mine in layout(variant)["per_rank"].items():
        ours = lay.owned(int(rank))
        assert len(ours) == len(mine["param_range_map_per_bucket"])
        for bucket, ranges in zip(ours, mine["param_range_map_per_bucket"]):
            got = {ORDER[i]: {k: {"start": r.start, "end": r.end, "size": r.size} for k, r in rs.items()}
                   for i, rs in bucket.items()}  # fmt: skip
            assert got == ranges


@pytest.mark.parametrize("variant", VARIANTS)
def test_first_ten_steps_match_megatron(variant):
    """Flat ZeRO-1 on dp 4, Megatron's layout: losses, grad norms, params and each rank's owned Adam
    moments (its contiguous shard of every bucket, padding included) after 10 steps from init."""
    zero = build(variant, registration_order=True)
    state, losses, norms = train(zero, init_state(zero, registration_order=True), 1, CHECKPOINT_STEP)
    assert_trace(losses, norms, trace(variant))
    final = final_params(variant)
    for name, x in zip(ORDER, jax.device_get(zero.full_params(state.params))):
        assert_close(x, final[name], name)
    adam = state.opt_state.inner_state[0]
    assert int(adam.count) == CHECKPOINT_STEP
    for rank in range(4):
        shards = rank_shards(variant, rank)
        for key, buckets in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):  # fp32: the params are the main params
            for b, x in enumerate(owned(zero, buckets, rank)):
                want = shards[f"bucket{b}/local_{key}"]
                assert_close(x, want, f"rank {rank} bucket {b} {key}")
                np.testing.assert_array_equal(x[want == 0], 0)  # padding and gaps stay exactly 0


# ---------------------------------------------------------------- the step-10 checkpoints


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_import_is_bit_exact(variant, fmt):
    ck = megatron.read(checkpoint(variant, fmt), bucket_size=VARIANTS[variant])
    assert ck.iteration == CHECKPOINT_STEP and ck.adam_step == CHECKPOINT_STEP
    assert list(ck.model) == list(ORDER)
    assert list(ck.bucket_numels) == [b["numel_unpadded"] for b in layout(variant)["buffer"]["buckets"]]
    final = final_params(variant)
    for name in ORDER:
        np.testing.assert_array_equal(ck.model[name], final[name])
        np.testing.assert_array_equal(ck.main[name], final[name])
    for rank in range(4):
        shards = rank_shards(variant, rank)
        for name in ORDER:
            if f"{name}/param_range" not in shards:
                continue
            start, end = shards[f"{name}/param_range"]
            for key, arrays in (("param", ck.main), ("exp_avg", ck.exp_avg), ("exp_avg_sq", ck.exp_avg_sq)):
                np.testing.assert_array_equal(arrays[name].reshape(-1)[start:end], shards[f"{name}/{key}"])
    # into jzero's flat ZeRO-1 on dp 4 in Megatron's order: every rank holds Megatron's shards bit for bit
    zero = build(variant, registration_order=True)
    state = megatron.to_train_state(ck, zero, list(ORDER))
    assert int(state.step) == CHECKPOINT_STEP
    adam = state.opt_state.inner_state[0]
    assert int(adam.count) == CHECKPOINT_STEP
    for rank in range(4):
        shards = rank_shards(variant, rank)
        for key, buckets in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
            for b, x in enumerate(owned(zero, buckets, rank)):
                np.testing.assert_array_equal(x, shards[f"bucket{b}/local_{key}"])


FAST = [  # every variant and format, both paths, both stages, dp 4 and another size
    ("single_bucket", "legacy", "flat", "optim", 4),
    ("single_bucket", "torch_dist", "spec", "optim_grads", 8),
    ("bucket1000", "legacy", "spec", "optim", 2),
    ("bucket1000", "torch_dist", "flat", "optim_grads", 4),
    ("bucket1000", "legacy", "flat", "optim_grads", 8),
    ("single_bucket", "torch_dist", "flat", "optim", 2),
    ("bucket1000", "torch_dist", "spec", "optim_grads_params", 8),  # ZeRO-3 takes it too
]
ALL = [
    (v, f, p, s, dp)
    for v in VARIANTS
    for f in FORMATS
    for p in ("flat", "spec")
    for s in ("optim", "optim_grads")
    for dp in (4, 2, 8)
] + [(v, f, "spec", s, 4) for v in VARIANTS for f in FORMATS for s in ("no_shard", "optim_grads_params")]


def _continue(variant, fmt, path, strategy, dp):
    zero = build(variant, strategy, path, dp)
    state = megatron.load(checkpoint(variant, fmt), zero, NAMES, bucket_size=VARIANTS[variant])
    state, losses, norms = train(zero, state, CHECKPOINT_STEP + 1, CHECKPOINT_STEP + 5)
    assert_trace(losses, norms, trace(variant, continued=True))
    final = final_params(variant, continued=True)
    for name, x in by_name(jax.device_get(zero.full_params(state.params))).items():
        assert_close(x, final[name], name)
    return zero, state


@pytest.mark.parametrize("variant,fmt,path,strategy,dp", FAST)
def test_continue_megatron_run(variant, fmt, path, strategy, dp):
    """Steps 11..15 from Megatron's step-10 checkpoint, as Megatron trained them."""
    _continue(variant, fmt, path, strategy, dp)


@pytest.mark.slow
@pytest.mark.parametrize("variant,fmt,path,strategy,dp", [c for c in ALL if c not in FAST])
def test_continue_megatron_run_everywhere(variant, fmt, path, strategy, dp):
    _continue(variant, fmt, path, strategy, dp)


# ---------------------------------------------------------------- out of jzero


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_is_megatrons_file_and_reads_back(variant, tmp_path):
    """jzero's export of the imported step-10 state holds Megatron's own tensors bit for bit; after 5
    more steps in jzero, the export reads back to jzero's state bit for bit."""
    bucket_size = VARIANTS[variant]
    zero = build(variant, "optim_grads", "spec", 8)
    state = megatron.load(checkpoint(variant, "legacy"), zero, NAMES, bucket_size=bucket_size)
    folder = megatron.save(tmp_path / "out", state, zero, NAMES, hyperparams=HYPERPARAMS, bucket_size=bucket_size,
                           order=ORDER)  # fmt: skip
    assert folder == tmp_path / "out" / "iter_0000010"
    assert (tmp_path / "out" / megatron.TRACKER).read_text() == "10"
    from jzero.interop import torch_format

    theirs = checkpoint(variant, "legacy") / "iter_0000010" / "mp_rank_00"
    for name in (megatron.MODEL_FILE, megatron.OPTIM_FILE):
        ours_sd, theirs_sd = torch_format.load(folder / "mp_rank_00" / name), torch_format.load(theirs / name)
        if name == megatron.OPTIM_FILE:
            ours_sd, theirs_sd = ours_sd[0], theirs_sd[0]
            assert list(ours_sd) == list(theirs_sd)  # the buffer's (param dtype, grad dtype) key
            ours_sd, theirs_sd = next(iter(ours_sd.values())), next(iter(theirs_sd.values()))
        else:
            assert ours_sd["iteration"] == theirs_sd["iteration"]
            assert ours_sd["opt_param_scheduler"] == theirs_sd["opt_param_scheduler"]
            mine = {(g["wd_mult"], g["lr_mult"]): g for g in ours_sd["optimizer"]["optimizer"]["param_groups"]}
            for g in theirs_sd["optimizer"]["optimizer"]["param_groups"]:
                # every key and value Megatron wrote; but the fixtures' OptimizerConfig left min_lr None
                # where Megatron-LM puts --min-lr (0.0 by default), as jzero does (a float: the decay needs it)
                assert {**mine[g["wd_mult"], g["lr_mult"]], "min_lr": None} == g
            ours_sd, theirs_sd = ours_sd["model"], theirs_sd["model"]
        assert list(ours_sd) == list(theirs_sd)
        for key, value in theirs_sd.items():
            np.testing.assert_array_equal(ours_sd[key], value, err_msg=f"{name} {key}")

    state, _, _ = train(zero, state, CHECKPOINT_STEP + 1, CHECKPOINT_STEP + 5)
    # into a new directory: "out"'s tracker is never overwritten
    megatron.save(tmp_path / "later", state, zero, NAMES, hyperparams=HYPERPARAMS, bucket_size=bucket_size,
                  order=ORDER)  # fmt: skip
    back = megatron.read(tmp_path / "later", bucket_size=bucket_size)
    assert back.iteration == back.adam_step == CHECKPOINT_STEP + 5
    params = by_name(jax.device_get(zero.full_params(state.params)))
    model_opt = jax.device_get(zero.to_model_space(state.opt_state)).inner_state[0]
    for name in ORDER:
        np.testing.assert_array_equal(back.model[name], params[name])
        np.testing.assert_array_equal(back.main[name], params[name])
    for key, tree in (("exp_avg", model_opt.mu), ("exp_avg_sq", model_opt.nu)):
        for name, x in by_name(tree).items():
            np.testing.assert_array_equal(getattr(back, key)[name], x)


# ---------------------------------------------------------------- why the tolerance


def test_adamw_rounding_against_torch_order():
    """One AdamW step from Megatron's step-10 state on the same clipped grads: jzero's optax order
    (`m = (1 - b1) g + b1 m`, `p - lr (m_hat / (sqrt(v_hat) + eps) + wd p)`) against torch's
    single-tensor order transcribed in numpy (weight decay first, lerp, bias corrections in float64;
    the fixtures' README). They differ in rounding only: each moment by at most 1 ulp of its operands,
    each param by at most 1 ulp of its tensor's largest value (measured: 6.1e-8 of it)."""
    import jax.numpy as jnp
    import optax

    from helpers import clip_by_global_norm
    from helpers.megatron_fixtures import B1, B2, CLIP, EPS, LR, WEIGHT_DECAY, inputs, loss_fn, tree
    from jzero.zero import groups

    ck = megatron.read(checkpoint("single_bucket", "legacy"))
    p, m, v = (jax.device_get(tree(x)) for x in (ck.main, ck.exp_avg, ck.exp_avg_sq))
    x = inputs()  # step 11's global batch; its grads (of the global mean, as Megatron's), clipped as Megatron clips
    grads, _ = clip_by_global_norm(jax.grad(loss_fn)(p, {"x": x["x"][10], "t": x["t"][10]}), CLIP)
    g = jax.device_get(grads)
    wd_mult = jax.tree.map(lambda x: float(x.ndim >= 2), p)
    tx = optax.with_extra_args_support(groups.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY))
    state = tx.init(p)
    state = (state[0]._replace(count=jnp.asarray(CHECKPOINT_STEP, jnp.int32), mu=m, nu=v), *state[1:])
    extra = groups.GroupValues(jax.tree.map(lambda _: 1.0, p), wd_mult)
    updates, state = jax.jit(lambda g, s, p: tx.update(g, s, p, param_groups=extra))(g, state, p)
    ours = jax.device_get((optax.apply_updates(p, updates), state[0].mu, state[0].nu))

    f32, t = np.float32, CHECKPOINT_STEP + 1

    def torch_adamw(p, g, m, v, wd):  # torch.optim.AdamW, single tensor, fp32 tensors and float64 scalars
        p = p * f32(1 - LR * WEIGHT_DECAY * wd)
        m = m + f32(1 - B1) * (g - m)
        v = v * f32(B2) + f32(1 - B2) * g * g
        return p + f32(-LR / (1 - B1**t)) * m / (np.sqrt(v) / f32((1 - B2**t) ** 0.5) + f32(EPS)), m, v

    for name, pn, mn, vn, p0, g0, m0, v0, wd in zip(
        jax.tree.leaves(NAMES), *(jax.tree.leaves(x) for x in (*ours, p, g, m, v, wd_mult))
    ):
        pt, mt, vt = torch_adamw(p0, g0, m0, v0, wd)
        assert np.all(np.abs(mn - mt) <= np.spacing(np.maximum(np.abs(m0), np.abs(g0)))), name
        assert np.all(np.abs(vn - vt) <= np.spacing(np.maximum(v0, g0 * g0))), name
        assert np.abs(pn - pt).max() <= np.spacing(np.abs(pt).max()), name


def test_bad_checkpoints_are_one_line(tmp_path):
    def refused(fn, *fragments):
        with pytest.raises(InteropError) as info:
            fn()
        assert "\n" not in str(info.value) and all(f in str(info.value) for f in fragments), str(info.value)

    legacy = checkpoint("bucket1000", "legacy")
    # the legacy file does not record its buckets: a wrong bucket size is caught by the sizes
    refused(lambda: megatron.read(legacy), "3200 elements", "3241", "--ddp-bucket-size")
    refused(lambda: megatron.read(legacy, bucket_size=300), "bucket_size=300")
    refused(lambda: megatron.read(tmp_path / "nothing"), "does not exist")
    refused(lambda: megatron.read(tmp_path), "is not a Megatron checkpoint")
    zero = build("bucket1000", "optim", "spec", 4)
    wrong = {**NAMES, "fc3": {"weight": "fc3.bias"}}
    refused(lambda: megatron.load(legacy, zero, wrong, bucket_size=1000), "fc3.weight", "no counterpart")
    swapped = {**NAMES, "fc1": {**NAMES["fc1"], "weight": "fc2.weight"}}
    swapped["fc2"] = {**NAMES["fc2"], "weight": "fc1.weight"}
    refused(lambda: megatron.load(legacy, zero, swapped, bucket_size=1000), "fc2.weight (11, 37) do not give")

    # a model-parallel rank folder without its files; a sharding type whose keys the checkpoint has not
    import shutil

    from jzero.interop import torch_format

    tp = tmp_path / "tp"
    shutil.copytree(legacy, tp)
    (tp / "iter_0000010" / "mp_rank_01").mkdir()
    refused(lambda: megatron.read(tp), "mp_rank_01", "does not exist")
    dist = tmp_path / "dist"
    shutil.copytree(checkpoint("bucket1000", "torch_dist"), dist)
    common = torch_format.load(dist / "common.pt")
    torch_format.save({**common, "optimizer": {"param_state_sharding_type": "fully_reshardable"}}, dist / "common.pt")
    refused(lambda: megatron.read(dist), "optimizer key optimizer.distributed", "fully_reshardable")

    # an optimizer that is not Adam has nothing to take Megatron's state
    import optax

    from helpers.megatron_fixtures import init_params, loss_fn
    from jzero.mesh import MeshConfig, make_mesh
    from jzero.zero import build_zero
    from jzero.zero.config import ZeroConfig

    abstract = jax.eval_shape(init_params)
    sgd = build_zero(loss_fn, optax.sgd(0.1, momentum=0.9), make_mesh(MeshConfig(dp=8)), abstract,
                     jax.tree.map(lambda _: jax.sharding.PartitionSpec(), abstract), ZeroConfig())  # fmt: skip
    refused(lambda: megatron.load(legacy, sgd, NAMES, bucket_size=1000), "trace", "Adam")


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_export_never_overwrites_megatrons_tracker(ckpt_format, tmp_path):
    """A directory holding Megatron's own run (its iter_N and latest_checkpointed_iteration.txt): the export
    refuses in one line naming the tracker, before writing anything (Megatron would load jzero's iteration)."""
    (tmp_path / "iter_0000100").mkdir()
    (tmp_path / megatron.TRACKER).write_text("100")
    model = {"embedding.word_embeddings.weight": np.ones((8, 4), np.float32)}
    from jzero.interop.megatron_save import write

    dp = 1 if ckpt_format == "torch_dist" else None
    with pytest.raises(InteropError) as info:
        write(tmp_path, iteration=2, model=model, main=model, exp_avg=model, exp_avg_sq=model, order=list(model),
              param_groups=[], scheduler={}, ckpt_format=ckpt_format, data_parallel=dp)  # fmt: skip
    assert str(info.value) == (
        f"{tmp_path / megatron.TRACKER} exists: jzero never overwrites a checkpoint's tracker; choose another directory"
    )
    assert (tmp_path / megatron.TRACKER).read_text() == "100"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100", megatron.TRACKER]


class Disk:
    """The disk under `root` holds `capacity` bytes: a write to a file opened under it that would pass that raises
    OSError(`error`) as a full disk does. Every file jzero writes is opened with `open` (`io.open`), so this is the
    lowest level its writers reach; `used` counts the bytes written."""

    def __init__(self, monkeypatch, root: Path, capacity: float = math.inf, error: int = errno.ENOSPC):
        self.root, self.capacity, self.error, self.used = root, capacity, error, 0
        real = io.open

        def opened(file, mode="r", *args, **kwargs):
            f = real(file, mode, *args, **kwargs)
            under = isinstance(file, str | os.PathLike) and Path(file).resolve().is_relative_to(root)
            return Disk.File(self, f) if under and set(mode) & set("wax+") else f

        monkeypatch.setattr(builtins, "open", opened)
        monkeypatch.setattr(io, "open", opened)

    class File:
        def __init__(self, disk: Disk, f):
            self._disk, self._f = disk, f

        def write(self, data) -> int:
            n = len(data) if isinstance(data, str) else memoryview(data).nbytes
            if self._disk.used + n > self._disk.capacity:
                raise OSError(self._disk.error, os.strerror(self._disk.error), self._f.name)
            self._disk.used += n
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()


def _write_tiny(out: Path, ckpt_format: str) -> Path:
    from jzero.interop.megatron_save import write

    model = {"embedding.word_embeddings.weight": np.ones((8, 4), np.float32)}
    return write(out, iteration=2, model=model, main=model, exp_avg=model, exp_avg_sq=model, order=list(model),
                 param_groups=[], scheduler={}, ckpt_format=ckpt_format,
                 data_parallel=1 if ckpt_format == "torch_dist" else None)  # fmt: skip


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
@pytest.mark.parametrize(
    "error, full",
    [("ENOSPC", "at once"), ("ENOSPC", "halfway"), ("ENOSPC", "at the tracker"), ("EDQUOT", "halfway"),
     ("EIO", "halfway")],
)  # fmt: skip
def test_a_failed_export_leaves_nothing(ckpt_format, error, full, tmp_path, monkeypatch):
    """A disk that fills (or fails) at the first byte, halfway, or at the tracker, the export's last byte: one line
    naming OUT_DIR, and nothing in it that looks like a checkpoint to Megatron (no tracker, no iter_N) nor half a
    file (*.tmp, the staging folder); a user's file in it untouched, an OUT_DIR the export made removed."""
    disk = Disk(monkeypatch, tmp_path)
    _write_tiny(tmp_path / "measured", ckpt_format)
    need = disk.used
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    disk.error = getattr(errno, error)
    disk.capacity = {"at once": 0, "halfway": need // 2, "at the tracker": need - 1}[full]
    for where in (out, tmp_path / "new" / "out"):
        disk.used = 0
        with pytest.raises(InteropError) as info:
            _write_tiny(where, ckpt_format)
        msg = str(info.value)
        assert full != "at the tracker" or Path(info.value.__cause__.filename).name == megatron.TRACKER
        assert "\n" not in msg and str(where) in msg and msg.endswith("; nothing was written there"), msg
        if error == "EIO":
            assert msg.startswith(f"exporting the Megatron checkpoint to {where} failed: OSError: [Errno 5]"), msg
        else:
            assert msg.startswith("no space left (on the device or in the quota) while exporting"), msg
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_an_export_leaves_only_the_checkpoint(ckpt_format, tmp_path):
    """No staging folder and no *.tmp beside or in iter_N; an existing iter_N is refused (never written into)."""
    (tmp_path / "notes.txt").write_text("mine")
    folder = _write_tiny(tmp_path, ckpt_format)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", megatron.TRACKER, "notes.txt"]
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]
    assert megatron.read(tmp_path).iteration == 2
    (tmp_path / megatron.TRACKER).unlink()
    with pytest.raises(InteropError, match="iter_0000002 exists: jzero never overwrites a checkpoint"):
        _write_tiny(tmp_path, ckpt_format)


def test_a_torch_dist_checkpoint_without_common_pt_is_refused_by_name(tmp_path):
    """common.pt says how the optimizer state is sharded: without it the read named the sharding type None (as
    though the checkpoint had no optimizer), not the missing file; a common.pt that is no dict is refused too."""
    from jzero.interop import torch_format

    folder = _write_tiny(tmp_path, "torch_dist")
    common = folder / "common.pt"
    kept = torch_format.load(common)
    common.unlink()
    with pytest.raises(InteropError) as info:
        megatron.read(tmp_path)
    assert str(info.value) == (
        f"{common} does not exist: a torch_dist checkpoint keeps its iteration, scheduler and optimizer sharding "
        "type there (Megatron writes it with the checkpoint)"
    )
    torch_format.save([kept], common)
    with pytest.raises(InteropError, match="holds a list, not Megatron's dict of the common state"):
        megatron.read(tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_run_moves_exactly(fmt, tmp_path):
    """Megatron's bf16 run (bf16 params, fp32 main params and grads, buffer key (bf16, fp32)) into jzero's
    bf16 params on flat ZeRO-2: the bf16 weights and the fp32 main params both as Megatron had them; and
    out again, Megatron's own legacy files bit for bit."""
    import jax.numpy as jnp

    from helpers.megatron_fixtures import BF16, DATA
    from jzero.interop import torch_format

    with np.load(DATA / BF16 / "final_params.npz") as f:  # bf16 weights, widened to fp32 (exact)
        weights = {k: f[k] for k in f.files}
    with np.load(DATA / BF16 / "final_main_params.npz") as f:
        main = {k: f[k] for k in f.files}
    zero = build("bucket1000", "optim_grads", "flat", 8, dtype=jnp.bfloat16)
    state = megatron.load(DATA / BF16 / FORMATS[fmt], zero, NAMES, bucket_size=1000)
    for name, x in by_name(jax.device_get(zero.full_params(state.params))).items():
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(x.astype(np.float32), weights[name])
    model_opt = jax.device_get(zero.to_model_space(state.opt_state))
    for name, x in by_name(model_opt.main_params).items():
        np.testing.assert_array_equal(x, main[name])
    folder = megatron.save(tmp_path, state, zero, NAMES, hyperparams=HYPERPARAMS, bucket_size=1000, order=ORDER)
    theirs = DATA / BF16 / "ckpt_legacy" / "iter_0000010" / "mp_rank_00"
    ours_model = torch_format.load(folder / "mp_rank_00" / megatron.MODEL_FILE)["model"]
    for name, x in torch_format.load(theirs / megatron.MODEL_FILE)["model"].items():
        assert ours_model[name].dtype == x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(ours_model[name], x)
    ours, theirs = (torch_format.load(d / megatron.OPTIM_FILE)[0] for d in (folder / "mp_rank_00", theirs))
    assert list(ours) == list(theirs) == [(torch_format.TorchDType("bfloat16"), torch_format.TorchDType("float32"))]
    for key in ("param", "exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(next(iter(ours.values()))[key], next(iter(theirs.values()))[key])
