"""PyTorch's `torch.save` files, read and written with numpy: torch is never imported, and nothing a
file holds is ever run.

A `.pt` file (torch >= 1.6) is a zip archive whose members all sit in one folder, `<name>/`:
`data.pkl`, a pickle whose tensors name raw storages by persistent id, the storages themselves
(`data/<key>`, little-endian bytes), `byteorder` and `version`.

Reading (`load`, `unpickle`): the pickle runs in an unpickler whose every global comes from an
allowlist of stand-ins (`GLOBALS`). Tensors become numpy arrays (bfloat16 as `ml_dtypes.bfloat16`),
torch dtypes `TorchDType` (hashable: Megatron keys dicts by `(torch.float32, torch.float32)`),
`torch.Size` a tuple, `OrderedDict` a dict; the few other classes a Megatron checkpoint holds
(argparse's Namespace, its enums, numpy's RNG state) become inert records (`Opaque`,
`Namespace`) that keep what the file says and construct nothing. Any other global is refused with
one line naming it, before anything is built, and a damaged file is one line too (`InteropError`).

Writing (`save`): a zip pickle that `torch.load(f, weights_only=True)` accepts, as torch writes it
(stored members aligned to 64 bytes, protocol 2, tensors rebuilt by `torch._utils._rebuild_tensor_v2`
from typed storages). The pickle is emitted opcode by opcode (`_Emitter`), for dicts, lists, tuples,
strings, numbers, None, numpy arrays (tensors) and `TorchDType`s: Python's pickler would import
torch to check the globals it names.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import ml_dtypes
import numpy as np

from jzero.errors import one_line
from jzero.interop import InteropError

# torch dtype name -> numpy dtype (the dtypes a checkpoint's tensors use)
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
# torch's typed storage classes (the persistent ids of tensors name one) -> torch dtype name
STORAGES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "UntypedStorage": "uint8",  # counted in bytes
}


@dataclasses.dataclass(frozen=True)
class TorchDType:
    """A torch dtype (`torch.float32`), as a hashable value; `numpy` is its numpy dtype."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    @property
    def numpy(self) -> np.dtype:
        return DTYPES[self.name]


def torch_dtype(dtype) -> TorchDType:
    """The TorchDType of a numpy dtype (InteropError if torch has none that jzero writes)."""
    dtype = np.dtype(dtype)
    for name, np_dtype in DTYPES.items():
        if np_dtype == dtype:
            return TorchDType(name)
    raise InteropError(f"no torch dtype for numpy dtype {dtype}")


@dataclasses.dataclass(frozen=True)
class _StorageType:
    dtype: str


class Opaque:
    """An object of an allowlisted class that jzero does not use (Megatron's enums and configs, numpy's
    RNG state): `global_name` and the arguments and state the file gave it, nothing constructed."""

    global_name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.global_name}{self.args!r}>"


def _opaque(module: str, name: str) -> type:
    return type(name, (Opaque,), {"global_name": f"{module}.{name}"})


class Namespace:
    """argparse's Namespace (Megatron-LM saves its args as one): attributes only."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise InteropError(f"a Namespace with state of type {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"Namespace({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class _Storage:
    """A storage of the archive, read (once) when a tensor first uses it."""

    def __init__(self, read: Callable[[str], bytes], key: str, dtype: str, numel: int, what: str):
        self._read, self.key, self.dtype, self.numel, self._what = read, key, dtype, numel, what
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            data = self._read(self.key)
            dtype = DTYPES[self.dtype]
            if len(data) != self.numel * dtype.itemsize:
                raise InteropError(
                    f"{self._what} is damaged: storage {self.key} holds {len(data)} bytes, not {self.numel} x "
                    f"{dtype.itemsize}"
                )
            self._array = np.frombuffer(data, dtype)
        return self._array


def _ints(value, what: str, name: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise InteropError(f"{what} is damaged: a tensor's {name} is {value!r}")
    return value


def _rebuild_tensor(what: str) -> Callable:
    """torch._utils._rebuild_tensor_v2 (and v1): a copy of the view `size`/`stride` at `offset`."""

    def rebuild(storage, offset, size, stride, *rest):
        if not isinstance(storage, _Storage) or not isinstance(offset, int) or offset < 0:
            raise InteropError(f"{what} is damaged: a tensor is not built from a storage")
        size, stride = _ints(tuple(size), what, "size"), _ints(tuple(stride), what, "stride")
        if len(size) != len(stride):
            raise InteropError(f"{what} is damaged: a tensor's size {size} and stride {stride} differ in length")
        base = storage.array
        if 0 in size:
            return np.zeros(size, base.dtype)
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= base.size:
            raise InteropError(f"{what} is damaged: a tensor reaches element {last} of a storage of {base.size}")
        item = base.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(base[offset:], size, tuple(s * item for s in stride), writeable=False)
        return np.array(view)

    return rebuild


class _TensorClass:
    """torch.Tensor / torch.nn.Parameter, as `_rebuild_from_type_v2` names them."""


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data


def _bytes_from_latin1(text, encoding="latin1"):
    """`_codecs.encode`, as pickle protocol 2 stores a bytes object: str.encode of a str, nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise InteropError(f"_codecs.encode of a {type(text).__name__} in {encoding!r}: not a pickled bytes object")
    return text.encode(encoding)


def _rebuild_from_type(what: str, builders: tuple, tensor_class: type) -> Callable:
    """torch._tensor._rebuild_from_type_v2: a tensor or Parameter rebuilt by one of `builders`."""

    def rebuild(func, new_type, args, state):
        if func not in builders or new_type is not tensor_class or not isinstance(args, tuple):
            raise InteropError(f"{what} is damaged: an unexpected tensor type")
        return func(*args)

    return rebuild


def _base_globals(what: str) -> dict[tuple[str, str], Any]:
    """The allowlist for one file (the tensor builders name it in their errors)."""
    rebuild = _rebuild_tensor(what)
    tensor = type("Tensor", (_TensorClass,), {})
    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): rebuild,
        ("torch._utils", "_rebuild_tensor"): rebuild,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type(what, (rebuild, _rebuild_parameter), tensor),
        ("torch", "Tensor"): tensor,
        ("torch.nn.parameter", "Parameter"): tensor,
        ("torch", "Size"): lambda dims=(): tuple(dims),
        ("torch", "device"): lambda *args: "device:" + ":".join(map(str, args)),
        ("collections", "OrderedDict"): OrderedDict,
        ("_codecs", "encode"): _bytes_from_latin1,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("argparse", "Namespace"): Namespace,
        ("types", "SimpleNamespace"): Namespace,
        ("pathlib", "PosixPath"): lambda *parts: str(PurePosixPath(*map(str, parts))),
    }
    allowed |= {("torch", name): TorchDType(name) for name in DTYPES}
    allowed |= {("torch", name): _StorageType(dtype) for name, dtype in STORAGES.items()}
    allowed[("torch.storage", "UntypedStorage")] = _StorageType("uint8")
    # What Megatron-LM's model_optim_rng.pt holds beside the weights (its safe_globals.py): kept inert.
    for module, name in (
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
        ("numpy", "dtype"), ("numpy.dtypes", "UInt32DType"), ("io", "BytesIO"), ("signal", "Signals"),
        ("megatron.core.enums", "ModelType"), ("megatron.core.optimizer", "OptimizerConfig"),
        ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
        ("megatron.core.rerun_state_machine", "RerunDiagnostic"), ("megatron.core.rerun_state_machine", "RerunMode"),
        ("megatron.core.rerun_state_machine", "RerunState"), ("megatron.core.transformer.enums", "AttnBackend"),
        ("megatron.core.transformer.enums", "CudaGraphScope"), ("torch.serialization", "_get_layout"),
    ):  # fmt: skip
        allowed[(module, name)] = _opaque(module, name)
    return allowed


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, what: str, allowed: Mapping, storage: Callable[..., _Storage] | None):
        super().__init__(io.BytesIO(data))
        self._what, self._allowed, self._storage = what, allowed, storage

    def find_class(self, module, name):
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise InteropError(
                f"{self._what} refers to {module}.{name}, which jzero does not load: it builds only tensors, "
                "containers and numbers from a checkpoint and never runs code from one"
            ) from None

    def persistent_load(self, pid):
        if self._storage is None:
            raise InteropError(f"{self._what} is damaged: a persistent id outside a torch archive")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise InteropError(f"{self._what} is damaged: unknown persistent id {str(pid)[:60]}")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise InteropError(f"{self._what} is damaged: persistent id {str(pid)[:60]}")
        return self._storage(key, kind.dtype, numel)


def unpickle(
    data: bytes,
    what: str,
    extra_globals: Mapping[tuple[str, str], Any] | None = None,
    storage: Callable[..., _Storage] | None = None,
) -> Any:
    """Runs the pickle `data` with the allowlist (plus `extra_globals`); `what` names it in errors."""
    allowed = _base_globals(what) | dict(extra_globals or {})
    try:
        return _Unpickler(data, what, allowed, storage).load()
    except InteropError:
        raise
    except RecursionError:
        raise InteropError(f"{what} is damaged: nested too deeply") from None
    except Exception as e:  # pickle raises many types for damaged data
        raise InteropError(f"{what} is damaged: {one_line(e)}") from None


def load(source: str | os.PathLike | bytes, what: str | None = None, extra_globals: Mapping | None = None) -> Any:
    """The object a `torch.save` file holds, tensors as numpy arrays (module docstring).

    Arguments:
      source: a path, or the file's bytes.
      what: how errors name it (default: the path).
    Raises:
      InteropError: not a torch zip file, damaged, or naming a global outside the allowlist.
    """
    what = what or str(source)
    try:
        archive = zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source)
    except FileNotFoundError:
        raise InteropError(f"{what} does not exist") from None
    except OSError as e:
        raise InteropError(f"{what} is unreadable: {e.strerror or e}") from None
    except (zipfile.BadZipFile, ValueError) as e:
        raise InteropError(
            f"{what} is not a PyTorch file that jzero reads (torch.save's zip format, torch >= 1.6): {one_line(e)}"
        ) from None
    with archive:
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise InteropError(f"{what} is not a PyTorch file: its zip archive has no <name>/data.pkl")
        prefix = pkl[0][: -len("data.pkl")]

        def read(member: str) -> bytes:
            try:
                return archive.read(prefix + member)
            except KeyError:
                raise InteropError(f"{what} is damaged: member {prefix + member} is missing") from None
            except (zipfile.BadZipFile, OSError, ValueError) as e:  # a bad CRC, a truncated member
                raise InteropError(f"{what} is damaged: {prefix + member}: {one_line(e)}") from None

        if prefix + "byteorder" in names and read("byteorder").strip() != b"little":
            raise InteropError(f"{what} was written on a big-endian machine, which jzero does not read")
        storages: dict[str, _Storage] = {}

        def storage(key: str, dtype: str, numel: int) -> _Storage:
            if key not in storages:
                storages[key] = _Storage(lambda k: read(f"data/{k}"), key, dtype, numel, what)
            return storages[key]

        return unpickle(read("data.pkl"), what, extra_globals, storage)


# ---------------------------------------------------------------- writing

ALIGNMENT = 64  # torch aligns every member's data to 64 bytes (its `.storage_alignment`)


@dataclasses.dataclass(frozen=True)
class Global:
    """A global a written pickle names (`module.name`), for `Reduce` and `Build`: never imported here."""

    module: str
    name: str


@dataclasses.dataclass(frozen=True)
class Reduce:
    """`func(*args)` in a written pickle (pickle's REDUCE): `torch.Size((2, 3))`, an enum by value."""

    func: Global
    args: tuple


@dataclasses.dataclass(frozen=True, eq=False)
class Build:
    """An object of class `cls` whose state is `state` (pickle's NEWOBJ then BUILD, as protocol 2 writes a
    dataclass or an argparse Namespace: `state` a dict of its fields, or what its `__setstate__` takes)."""

    cls: Global
    state: Any


class _Emitter:
    """Pickle protocol 2, opcode by opcode, for the values a Megatron checkpoint holds."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")
        self.storages: list[np.ndarray] = []

    def _global(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def _str(self, s: str) -> None:
        data = s.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(data)) + data

    def _tuple(self, items) -> None:
        self.out += b"("
        for item in items:
            self.value(item)
        self.out += b"t"

    def _ordered_dict(self, items) -> None:
        self._global("collections", "OrderedDict")
        self.out += b")R"
        self._setitems(items)

    def _setitems(self, items) -> None:
        items = list(items)
        if items:
            self.out += b"("
            for k, v in items:
                self.value(k)
                self.value(v)
            self.out += b"u"

    def _tensor(self, x: np.ndarray) -> None:
        x = np.array(x, order="C", copy=None)  # np.ascontiguousarray would make a 0-d array 1-d
        dtype = torch_dtype(x.dtype)
        storage = next(name for name, d in STORAGES.items() if d == dtype.name)
        key = str(len(self.storages))
        self.storages.append(x)
        stride = tuple(int(s) // x.itemsize for s in x.strides) if x.size else (1,) * x.ndim
        self._global("torch._utils", "_rebuild_tensor_v2")
        self.out += b"("  # the arguments
        self.out += b"("  # the persistent id: ('storage', type, key, location, numel)
        self._str("storage")
        self._global("torch", storage)
        self._str(key)
        self._str("cpu")
        self.value(int(x.size))
        self.out += b"tQ"
        self.value(0)
        self._tuple(int(n) for n in x.shape)
        self._tuple(stride)
        self.out += b"\x89"  # requires_grad False
        self._ordered_dict(())  # backward hooks
        self.out += b"tR"

    def value(self, v: Any) -> None:
        if v is None:
            self.out += b"N"
        elif v is True or v is False:
            self.out += b"\x88" if v else b"\x89"
        elif isinstance(v, (int, np.integer)):
            v = int(v)
            if -(2**31) <= v < 2**31:
                self.out += b"J" + struct.pack("<i", v)
            else:
                data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
                self.out += b"\x8a" + bytes([len(data)]) + data
        elif isinstance(v, (float, np.floating)):
            self.out += b"G" + struct.pack(">d", float(v))
        elif isinstance(v, str):
            self._str(v)
        elif isinstance(v, TorchDType):
            self._global("torch", v.name)
        elif isinstance(v, np.ndarray):
            self._tensor(v)
        elif isinstance(v, Global):
            self._global(v.module, v.name)
        elif isinstance(v, Reduce):
            self.value(v.func)
            self._tuple(v.args)
            self.out += b"R"
        elif isinstance(v, Build):
            self.value(v.cls)
            self.out += b")\x81"  # NEWOBJ with no arguments
            self.value(v.state)
            self.out += b"b"
        elif isinstance(v, Namespace):
            self.value(Build(Global("argparse", "Namespace"), dict(v.__dict__)))
        elif isinstance(v, bytes):
            self.value(Reduce(Global("_codecs", "encode"), (v.decode("latin1"), "latin1")))
        elif isinstance(v, tuple):
            self._tuple(v)
        elif isinstance(v, list):
            self.out += b"]"
            if v:
                self.out += b"("
                for item in v:
                    self.value(item)
                self.out += b"e"
        elif isinstance(v, OrderedDict):
            self._ordered_dict(v.items())
        elif isinstance(v, dict):
            self.out += b"}"
            self._setitems(v.items())
        else:
            raise TypeError(f"jzero does not write {type(v).__name__} into a torch file")


def _bytes(x: np.ndarray) -> memoryview:
    return memoryview(x.reshape(-1).view(np.uint8))  # `x` is C-contiguous (`_Emitter._tensor`)


def pickled(obj: Any) -> bytes:
    """`obj` as a plain pickle (protocol 2; no tensors): what `pickle.dumps` would give, torch not imported."""
    emitter = _Emitter()
    emitter.value(obj)
    if emitter.storages:
        raise TypeError("a plain pickle holds no tensors: use dumps")
    return bytes(emitter.out + b".")


def dumps(obj: Any, archive: str = "archive") -> bytes:
    """The bytes of `torch.save(obj, buffer)` (module docstring): a torch zip file in memory."""
    buf = io.BytesIO()
    _write_zip(obj, buf, archive)
    return buf.getvalue()


def save(obj: Any, path: str | os.PathLike) -> None:
    """Writes `obj` as `torch.save(obj, path)` would (module docstring), atomically (a temporary file
    beside `path`, then renamed; removed again if the write fails). The archive folder is the file's stem,
    as torch names it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    f = open(tmp, "wb")  # once it is open, its bytes are this call's: a failure below may remove it
    try:
        with f:
            _write_zip(obj, f, path.stem or "archive")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_zip(obj: Any, target, archive: str) -> None:
    emitter = _Emitter()
    emitter.value(obj)
    emitter.out += b"."
    records: list[tuple[str, Any]] = [
        ("data.pkl", bytes(emitter.out)), (".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", b"little"),
    ]  # fmt: skip
    records += [(f"data/{i}", _bytes(x)) for i, x in enumerate(emitter.storages)]
    records.append(("version", b"3\n"))
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in records:
            info = zipfile.ZipInfo(f"{archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            size = memoryview(data).nbytes
            zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # as zipfile decides it for writestr
            header = 30 + len(info.filename.encode()) + 4 + (20 if zip64 else 0)
            pad = -(zf.fp.tell() + header) % ALIGNMENT
            info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch's own padding field
            zf.writestr(info, data)
