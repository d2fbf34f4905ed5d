"""PyTorch's files without torch: Megatron's checkpoints read as torch reads them, jzero's writes read
back, and every foreign or damaged file refused in one line without running anything."""

from __future__ import annotations

import json
import struct
import zipfile
from collections import OrderedDict

import ml_dtypes
import numpy as np
import pytest

from helpers.megatron_fixtures import DATA, VARIANTS, final_params
from jzero.interop import InteropError, torch_format
from jzero.interop.torch_dist import TorchDist

LEGACY = "ckpt_legacy/iter_0000010/mp_rank_00"


def describe(obj):
    """The structure as the fixtures' checkpoint_structure.json records it (torch.load's view)."""
    if isinstance(obj, np.ndarray):
        return {"tensor": {"dtype": repr(torch_format.torch_dtype(obj.dtype)), "shape": list(obj.shape)}}
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [describe(v) for v in obj]
    return obj


@pytest.mark.parametrize("variant", VARIANTS)
def test_legacy_files_read_as_torch_reads_them(variant):
    recorded = json.loads((DATA / variant / "checkpoint_structure.json").read_text())
    for name in ("model_optim_rng.pt", "distrib_optim.pt"):
        got = torch_format.load(DATA / variant / LEGACY / name)
        assert json.loads(json.dumps(describe(got))) == recorded[f"{LEGACY}/{name}"]["structure"]
    model = torch_format.load(DATA / variant / LEGACY / "model_optim_rng.pt")["model"]
    final = final_params(variant)
    assert list(model) == list(final)  # registration order
    for name, x in model.items():  # the step-10 params, bit for bit (views of Megatron's one param buffer)
        np.testing.assert_array_equal(x, final[name])
    optim = torch_format.load(DATA / variant / LEGACY / "distrib_optim.pt")
    (key,) = optim[0]
    f32 = (torch_format.TorchDType("float32"),) * 2  # a dict key as torch's dtypes are: by value
    assert key == f32 and hash(key) == hash(f32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_dist_read_as_torch_reads_it(variant):
    recorded = json.loads((DATA / variant / "checkpoint_structure.json").read_text())["ckpt_torch_dist_dp_reshardable"]
    td = TorchDist(DATA / variant / "ckpt_torch_dist_dp_reshardable")
    assert json.loads(json.dumps(describe(td.common))) == recorded["common.pt"]
    tensors = {k for k in td.keys if td.is_tensor(k)}
    assert tensors == {k for k, v in recorded["dcp_metadata"].items() if isinstance(v, dict)}
    for k in tensors:
        meta = recorded["dcp_metadata"][k]
        assert list(td.shape(k)) == meta["global_shape"]
        assert [(list(o), list(s)) for o, s in td.chunks(k)] == [(c["offsets"], c["sizes"]) for c in meta["chunks"]]
    where = sorted((k, None if o is None else list(o), f, start, n) for k, o, f, start, n in td.locations())
    want = sorted(
        (e["fqn"], e["offset"], f, *e["bytes"]) for f, entries in recorded["dcp_storage_files"].items() for e in entries
    )
    assert where == want
    final = final_params(variant)
    for name in final:
        np.testing.assert_array_equal(td.tensor(name), final[name])


def test_write_then_read_and_alignment(tmp_path):
    obj = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "transposed": np.arange(6, dtype=np.float64).reshape(2, 3).T,  # written contiguous
        "bf16": np.array([1.5, -2.0, 3.25], ml_dtypes.bfloat16),
        "scalar": np.array(7, np.int64),
        "empty": np.zeros((0, 4), np.int32),
        0: OrderedDict([("b", 1), ("a", [None, True, False, 2**40, -(2**40), 1.5, "é"])]),
        (torch_format.TorchDType("bfloat16"), torch_format.TorchDType("float32")): (1, (2, 3)),
    }
    path = tmp_path / "thing.pt"
    torch_format.save(obj, path)
    got = torch_format.load(path)
    assert list(got) == list(obj)
    for k, v in obj.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)
        else:
            assert got[k] == v
    assert isinstance(got[0], OrderedDict) and list(got[0]) == ["b", "a"]
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            assert info.filename.startswith("thing/")
            assert info.compress_type == zipfile.ZIP_STORED
            start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
            assert start % torch_format.ALIGNMENT == 0, info.filename  # as torch aligns its records


def _archive(tmp_path, pickle_bytes: bytes, storages: dict | None = None, byteorder: bytes = b"little"):
    path = tmp_path / "crafted.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("crafted/data.pkl", pickle_bytes)
        zf.writestr("crafted/byteorder", byteorder)
        for key, data in (storages or {}).items():
            zf.writestr(f"crafted/data/{key}", data)
    return path


def _tensor_pickle(numel: int, size: tuple, stride: tuple, offset: int = 0) -> bytes:
    """A protocol-2 pickle of one float32 tensor over storage '0' (as torch writes it)."""
    e = torch_format._Emitter()
    e._global("torch._utils", "_rebuild_tensor_v2")
    e.out += b"((" + b"X\x07\x00\x00\x00storage"
    e._global("torch", "FloatStorage")
    e.value("0")
    e.value("cpu")
    e.value(numel)
    e.out += b"tQ"
    e.value(offset)
    e._tuple(size)
    e._tuple(stride)
    e.out += b"\x89"
    e._ordered_dict(())
    e.out += b"tR."
    return bytes(e.out)


def _refused(path, *fragments) -> str:
    with pytest.raises(InteropError) as info:
        torch_format.load(path)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


def test_code_in_a_file_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # protocol 0: os.system("touch ...")
    _refused(_archive(tmp_path, payload), "os.system", "never runs code")
    assert not marker.exists()
    # the same through the other ways a pickle names a global: STACK_GLOBAL and INST
    stack = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94."
    _refused(_archive(tmp_path, stack), "builtins.eval")
    _refused(_archive(tmp_path, b"(ibuiltins\nexec\n."), "builtins.exec")
    # an allowlisted name under another module is still refused
    _refused(_archive(tmp_path, b"ctorch._utils\nsystem\n."), "torch._utils.system")


def test_damaged_or_foreign_files_are_one_line(tmp_path):
    good = DATA / "single_bucket" / LEGACY / "distrib_optim.pt"
    data = good.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    _refused(tmp_path / "cut.pt", "cut.pt")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside a storage: the zip's CRC catches it
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    _refused(tmp_path / "flipped.pt", "damaged")
    (tmp_path / "text.pt").write_text("not a checkpoint")
    _refused(tmp_path / "text.pt", "not a PyTorch file")
    _refused(tmp_path / "missing.pt", "does not exist")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("readme.txt", "hello")
    _refused(tmp_path / "other.zip", "no <name>/data.pkl")
    _refused(_archive(tmp_path, b"\x80\x02}q\x00(X\x01"), "damaged")  # the pickle stops mid-way
    _refused(_archive(tmp_path, _tensor_pickle(4, (4,), (1,)), {"0": b"\x00" * 12}), "storage 0 holds 12 bytes")
    _refused(_archive(tmp_path, _tensor_pickle(4, (3,), (2,)), {"0": b"\x00" * 16}), "reaches element 4")
    _refused(_archive(tmp_path, _tensor_pickle(4, (4,), (1,)), {}), "member crafted/data/0 is missing")
    _refused(_archive(tmp_path, _tensor_pickle(4, (4,), (1,)), {"0": b"\x00" * 16}, b"big"), "big-endian")
    ok = _archive(tmp_path, _tensor_pickle(4, (2, 2), (1, 2)), {"0": struct.pack("<4f", 1, 2, 3, 4)})
    np.testing.assert_array_equal(torch_format.load(ok), [[1, 3], [2, 4]])  # a strided view, copied


def test_dcp_metadata_with_a_foreign_global_is_refused(tmp_path):
    src = DATA / "single_bucket" / "ckpt_torch_dist_dp_reshardable"
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    (dst / ".metadata").write_bytes(b"csubprocess\ncall\n(S'true'\ntR.")
    with pytest.raises(InteropError, match=r"subprocess\.call"):
        TorchDist(dst)
    (dst / ".metadata").write_bytes(b"\x80\x02")
    with pytest.raises(InteropError, match="damaged"):
        TorchDist(dst)


def test_megatron_lm_model_file_with_args_and_rng_state(tmp_path):
    """What Megatron-LM's model_optim_rng.pt holds beside the weights (its args, RNG states, rerun state:
    tests/data/megatron/bucket1000_args/make.py wrote it with torch) loads, inert; and the args give the
    bucket size the legacy files do not record."""
    import shutil

    from jzero.interop import megatron

    sd = torch_format.load(DATA / "bucket1000_args" / "model_optim_rng.pt")
    args = sd["args"]
    assert args.ddp_bucket_size == 1000 and args.overlap_grad_reduce is True and args.save == "/ckpts/run"
    assert args.params_dtype == torch_format.TorchDType("float32")
    assert args.attention_backend.global_name == "megatron.core.transformer.enums.AttnBackend"
    assert isinstance(sd["rng_state"][0]["torch_rng_state"], np.ndarray)  # a uint8 storage
    folder = tmp_path / "iter_0000010" / "mp_rank_00"
    folder.mkdir(parents=True)
    shutil.copy(DATA / "bucket1000_args" / "model_optim_rng.pt", folder)
    shutil.copy(DATA / "bucket1000" / LEGACY / "distrib_optim.pt", folder)
    ck = megatron.read(tmp_path / "iter_0000010")
    assert ck.bucket_numels == (1111, 2089) and "the run's args (--ddp-bucket-size)" in ck.notes[0]
    for name, x in final_params("bucket1000").items():
        np.testing.assert_array_equal(ck.main[name], x)
