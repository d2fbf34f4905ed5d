"""Megatron's `torch_dist` checkpoints (a PyTorch Distributed Checkpoint), read with numpy alone.

A `torch_dist` directory holds:
  metadata.json     {"sharded_backend": "torch_dist", ...} (Megatron's marker)
  common.pt         what is not sharded (iteration, the scheduler, the optimizer's sharding type),
                    a `torch.save` file (`torch_format.load`)
  .metadata         a pickle of torch.distributed.checkpoint's `Metadata`: per key, a tensor's global
                    shape and chunks or a bytes object, and where each chunk lies (`storage_data`:
                    file, offset, length)
  __<r>_<i>.distcp  the chunks, each a `torch.save` file of one tensor (or of one Python object)

`.metadata` is unpickled with inert stand-ins for the allowlisted classes of
torch.distributed.checkpoint (`_DCP_CLASSES`); any other global is refused in one line, as in
`torch_format`. `TorchDist.tensor` assembles a key's global array from its chunks, `TorchDist.object`
unpickles a bytes entry; each reads only its own byte ranges.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jzero.errors import one_line
from jzero.interop import InteropError, torch_format
from jzero.paths import not_a_file

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
}  # fmt: skip
METADATA_FILE = ".metadata"
MARKER_FILE = "metadata.json"
COMMON_FILE = "common.pt"


class _Record:
    """A stand-in for one torch.distributed.checkpoint class: the fields the file gives it."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        else:
            self.state = state


def _dcp_globals() -> dict[tuple[str, str], type]:
    return {(m, n): type(n, (_Record,), {}) for m, names in _DCP_CLASSES.items() for n in names}


def _common(path: Path) -> dict:
    """common.pt: Megatron writes it with every torch_dist checkpoint, and only it says how the optimizer state
    is sharded, so a checkpoint without it is refused by that name, not read as one without an optimizer."""
    if not path.exists():
        raise InteropError(
            f"{path} does not exist: a torch_dist checkpoint keeps its iteration, scheduler and optimizer sharding "
            "type there (Megatron writes it with the checkpoint)"
        )
    if not_a_file(path):  # a FIFO would block the read forever
        raise InteropError(f"{path} is not a regular file")
    common = torch_format.load(path)
    if not isinstance(common, dict):
        raise InteropError(f"{path} holds a {type(common).__name__}, not Megatron's dict of the common state")
    return common


def is_torch_dist(directory: Path) -> bool:
    """Whether `directory` is a torch_dist checkpoint (Megatron's metadata.json, or DCP's .metadata)."""
    return (directory / MARKER_FILE).is_file() or (directory / METADATA_FILE).is_file()


class TorchDist:
    """One torch_dist checkpoint directory, opened: `keys` in the file's order, `common` (common.pt)."""

    def __init__(self, directory: str | Path):
        self.directory = directory = Path(directory)
        marker = directory / MARKER_FILE
        if marker.is_file():
            try:
                backend = json.loads(marker.read_text()).get("sharded_backend")
            except (OSError, ValueError, AttributeError) as e:
                raise InteropError(f"{marker} is unreadable: {one_line(e)}") from None
            if backend != "torch_dist":
                raise InteropError(
                    f"{directory} is a Megatron checkpoint of backend {backend!r}; jzero reads torch_dist and the "
                    "legacy format (--ckpt-format torch)"
                )
        path = directory / METADATA_FILE
        if not_a_file(path):  # a FIFO would block the read forever
            raise InteropError(f"{path} is not a regular file")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InteropError(f"{path} is unreadable: {e.strerror or e}") from None
        md = torch_format.unpickle(data, str(path), _dcp_globals())
        entries = getattr(md, "state_dict_metadata", None)
        storage = getattr(md, "storage_data", None)
        if not isinstance(entries, dict) or not isinstance(storage, dict):
            raise InteropError(f"{path} is not a torch.distributed.checkpoint Metadata")
        self._entries: dict[str, Any] = entries
        self._where: dict[tuple[str, tuple | None], Any] = {}
        for index, info in storage.items():
            fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
            if not isinstance(fqn, str) or not isinstance(getattr(info, "relative_path", None), str):
                raise InteropError(f"{path} is damaged: a storage entry without a key or file")
            if getattr(info, "transform_descriptors", None):
                raise InteropError(f"{path}: {fqn} is stored transformed (compressed?), which jzero does not read")
            self._where[fqn, None if offset is None else tuple(offset)] = info
        self.common = _common(directory / COMMON_FILE)

    @property
    def keys(self) -> list[str]:
        return list(self._entries)

    def is_tensor(self, key: str) -> bool:
        return hasattr(self._entries.get(key), "chunks")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entries[key].size)

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of every chunk of the tensor `key`, as the file lists them."""
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self._entries[key].chunks]

    def locations(self) -> list[tuple[str, tuple | None, str, int, int]]:
        """Every stored item: (key, chunk offsets or None for an object, file, byte offset, length)."""
        return [(k, o, i.relative_path, int(i.offset), int(i.length)) for (k, o), i in self._where.items()]

    def _read(self, key: str, offset: tuple | None) -> Any:
        info = self._where.get((key, offset))
        if info is None:
            raise InteropError(f"{self.directory}: {key} (chunk at {offset}) has no storage entry in {METADATA_FILE}")
        path = self.directory / info.relative_path
        if Path(info.relative_path).is_absolute() or ".." in Path(info.relative_path).parts:
            raise InteropError(f"{self.directory}/{METADATA_FILE} points outside the checkpoint: {info.relative_path}")
        if not_a_file(path):  # a FIFO would block the read forever
            raise InteropError(f"{path} is not a regular file")
        try:
            with open(path, "rb") as f:
                f.seek(int(info.offset))
                data = f.read(int(info.length))
        except OSError as e:
            raise InteropError(f"{path} is unreadable: {e.strerror or e}") from None
        if len(data) != int(info.length):
            raise InteropError(f"{path} is truncated: {key} needs bytes up to {info.offset + info.length}")
        return torch_format.load(data, what=f"{path} ({key})")

    def tensor(self, key: str) -> np.ndarray:
        """The global array of `key`, assembled from its chunks."""
        entry = self._entries.get(key)
        if not hasattr(entry, "chunks"):
            raise InteropError(f"{self.directory}: no tensor {key} in the checkpoint")
        shape = tuple(entry.size)
        dtype = getattr(getattr(entry, "properties", None), "state", (None,))[0]
        out = np.zeros(shape, dtype.numpy if isinstance(dtype, torch_format.TorchDType) else np.float32)
        for chunk in entry.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            piece = np.asarray(self._read(key, offsets))
            if piece.shape != sizes or any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
                raise InteropError(f"{self.directory} is damaged: chunk {offsets} of {key} has shape {piece.shape}")
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = piece
        return out

    def object(self, key: str) -> Any:
        """The Python object stored under the bytes entry `key`."""
        if key not in self._entries or self.is_tensor(key):
            raise InteropError(f"{self.directory}: no object {key} in the checkpoint")
        return self._read(key, None)


# ---------------------------------------------------------------- writing

_DCP = "torch.distributed.checkpoint.metadata"
DATA_FILE = "__0_0.distcp"  # one file: torch's DCP reader takes any file names the metadata gives


def _dcp(name: str, state: Any, module: str = _DCP) -> torch_format.Build:
    return torch_format.Build(torch_format.Global(module, name), state)


def _size(dims) -> torch_format.Reduce:
    return torch_format.Reduce(torch_format.Global("torch", "Size"), (tuple(int(d) for d in dims),))


def _properties(dtype) -> torch_format.Build:
    """TensorProperties(dtype, torch.strided, requires_grad False, contiguous, pin_memory False): its
    `__setstate__` takes that tuple."""
    layout = torch_format.Reduce(torch_format.Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = torch_format.Reduce(torch_format.Global(_DCP, "_MEM_FORMAT_ENCODING"), (0,))
    return _dcp("TensorProperties", (torch_format.torch_dtype(dtype), layout, False, contiguous, False))


def write(
    directory: str | Path,
    tensors: dict[str, np.ndarray],
    objects: dict[str, Any],
    common: dict,
    marker: dict,
    row_chunks: dict[str, int] | None = None,
) -> None:
    """Writes a torch_dist checkpoint (module docstring) into `directory` (created; it must not hold one):
    each of `tensors` whole, as one chunk, and each of `objects` as torch.save's bytes, all in one
    `.distcp` file; `.metadata`, a DCP `Metadata` pickle that torch's own reader loads (`pickle.load`:
    the same classes and fields torch writes); `common.pt` (`common`) and Megatron's `metadata.json`
    (`marker`). Keys are written in the order given, tensors first. `row_chunks`: tensors written as that
    many chunks of equal rows (dim 0) instead, as Megatron saves a vocab-parallel embedding (readers
    take the tensor-parallel size from it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / METADATA_FILE).exists():
        raise InteropError(f"{directory} already holds a torch_dist checkpoint: jzero never overwrites one")
    entries: dict[str, Any] = {}
    storage: list[tuple[Any, Any]] = []
    tmp = directory / (DATA_FILE + ".tmp")
    with open(tmp, "wb") as f:
        for key, x in tensors.items():
            x = np.asarray(x)
            n = (row_chunks or {}).get(key, 1)
            if x.ndim == 0 or len(x) % n:
                raise InteropError(f"{directory}: {key} of shape {x.shape} does not split into {n} chunks of rows")
            chunks = []
            for i in range(n):
                rows = len(x) // n if x.ndim else 0
                piece = x[i * rows : (i + 1) * rows] if n > 1 else x
                offset, data = f.tell(), torch_format.dumps(piece)
                f.write(data)
                at = _size((i * rows,) + (0,) * (x.ndim - 1))
                chunks.append(_dcp("ChunkStorageMetadata", {"offsets": at, "sizes": _size(piece.shape)}))
                storage.append(({"fqn": key, "offset": at, "index": i}, (offset, len(data))))
            entries[key] = _dcp(
                "TensorStorageMetadata", {"properties": _properties(x.dtype), "size": _size(x.shape), "chunks": chunks}
            )
        for key, obj in objects.items():
            offset, data = f.tell(), torch_format.dumps(obj)
            f.write(data)
            entries[key] = _dcp("BytesStorageMetadata", {})
            storage.append(({"fqn": key, "offset": None, "index": None}, (offset, len(data))))
    os.replace(tmp, directory / DATA_FILE)
    storage_data = {
        _dcp("MetadataIndex", index): _dcp(
            "_StorageInfo", {"relative_path": DATA_FILE, "offset": offset, "length": length},
            "torch.distributed.checkpoint.filesystem",
        )
        for index, (offset, length) in storage
    }  # fmt: skip
    save_id = hashlib.sha256(b"".join(k.encode() for k in entries)).hexdigest()
    meta = {
        "checkpoint_id": directory.name,
        "save_id": f"{save_id[:8]}-{save_id[8:12]}-{save_id[12:16]}-{save_id[16:20]}-{save_id[20:32]}",
        "load_id": None,
        "modules": [],
    }
    metadata = _dcp("Metadata", {
        "state_dict_metadata": entries, "planner_data": None, "storage_data": storage_data,
        "storage_meta": _dcp("StorageMeta", meta), "version": "1.0.0",
    })  # fmt: skip
    torch_format.save(common, directory / COMMON_FILE)
    (directory / MARKER_FILE).write_text(json.dumps(marker))
    (directory / METADATA_FILE).write_bytes(torch_format.pickled(metadata))
