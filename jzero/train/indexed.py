"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read and written with numpy alone.

The format is the one `megatron/core/datasets/indexed_dataset.py` (NVIDIA/Megatron-LM) writes with
`IndexedDatasetBuilder` + `_IndexWriter` and reads with `_IndexReader` + `_MMapBinReader`, which
Megatron's `tools/preprocess_data.py` produces. Integers are little-endian:

    PREFIX.idx
      9 bytes      b"MMIDIDX\\x00\\x00"                 (_INDEX_HEADER)
      uint64       version = 1
      uint8        dtype code of the tokens             (DType: 1 uint8, 2 int8, 3 int16, 4 int32,
                                                         5 int64, 6 float64, 7 float32, 8 uint16)
      uint64       S, the number of sequences
      uint64       D + 1, the length of document_indices
      int32[S]     sequence_lengths, in tokens
      int64[S]     sequence_pointers, byte offsets of the sequences in PREFIX.bin
      int64[D + 1] document_indices: document d is sequences [doc[d], doc[d + 1]); doc[0] = 0, doc[D] = S
      (int8[S]     sequence_modes, multimodal datasets only; not read here)
    PREFIX.bin
      the sequences' tokens back to back, in the index's dtype

Megatron's writer lays the sequences out contiguously (pointer i = the tokens before sequence i x
itemsize), so PREFIX.bin is one token stream whose document boundaries the index records; jzero
reads it as such a stream (`jzero.train.data.TokenData`) and checks that it is one. preprocess_data
writes one sequence per document (several with --split-sentences), in uint16 when the tokenizer's
vocabulary is below 65500, else int32 (`DType.optimal_dtype`).

Every problem with the files is one `ConfigError` line naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from jzero.errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # header 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CHUNK = 1 << 22  # sequences checked at a time: the index is never copied whole


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """Megatron's `DType.optimal_dtype`: uint16 for a vocabulary below 65500, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    """Megatron's `DType.code_from_dtype`."""
    codes = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
    return codes[np.dtype(dtype)]


@dataclasses.dataclass(frozen=True)
class IndexedFile:
    """One indexed dataset, memory-mapped (nothing is read until sliced).

    Attributes:
      prefix: the path prefix (PREFIX.bin, PREFIX.idx).
      dtype: the tokens' numpy dtype.
      sequence_lengths: int32 [S], tokens per sequence.
      sequence_pointers: int64 [S], byte offset of each sequence in PREFIX.bin.
      document_indices: int64 [D + 1], document d = sequences [doc[d], doc[d + 1]).
      tokens: [N] the whole .bin as one token stream, N = sum of the lengths.
    """

    prefix: str
    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray
    tokens: np.ndarray

    def document_starts(self) -> np.ndarray:
        """int64 [D]: the token offset in `tokens` where each document starts."""
        first = self.document_indices[:-1]
        starts = self.sequence_pointers[np.minimum(first, len(self.sequence_pointers) - 1)] // self.dtype.itemsize
        return np.where(first < len(self.sequence_pointers), starts, len(self.tokens))

    def document(self, d: int) -> list[np.ndarray]:
        """Document d's sequences (Megatron's `IndexedDataset[i]` for each of its sequences)."""
        lo, hi = self.document_indices[d], self.document_indices[d + 1]
        out = []
        for i in range(lo, hi):
            start = self.sequence_pointers[i] // self.dtype.itemsize
            out.append(self.tokens[start : start + self.sequence_lengths[i]])
        return out


def read_indexed(prefix: str, key: str = "data.path") -> IndexedFile:
    """Opens PREFIX.idx and PREFIX.bin (module docstring), checking the index against the data.

    Arguments:
      prefix: the path prefix, without .bin/.idx.
      key: the config key that named it, for the errors.
    Raises:
      ConfigError: a file is missing, not an index (magic), another version, an unknown or
        non-integer dtype code, truncated, inconsistent, or holds no tokens.
    """
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise ConfigError(
                f"{key}={prefix!r}: {path} does not exist (an indexed dataset is PREFIX.bin + PREFIX.idx)"
            )
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[: len(INDEX_HEADER)] != INDEX_HEADER and not (len(head) < 9 and INDEX_HEADER.startswith(head)):
        raise ConfigError(f"{idx} is not a Megatron index: it starts {head[:9]!r}, not {INDEX_HEADER!r}")
    if len(head) < HEADER_BYTES:
        raise ConfigError(f"{idx} is truncated: {size} bytes, its header alone is {HEADER_BYTES}")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise ConfigError(f"{idx} has index version {version}; Megatron's format (and jzero) reads version 1")
    (code,) = struct.unpack("<B", head[17:18])
    if code not in DTYPE_CODES:
        raise ConfigError(f"{idx} has dtype code {code}, not one of Megatron's DType codes 1-8")
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind == "f":
        raise ConfigError(f"{idx} holds {dtype.name} values (dtype code {code}), not integer token ids")
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    need = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if size < need:
        raise ConfigError(
            f"{idx} is truncated: {size} bytes, its {n_seq} sequences and {n_doc} document indices need {need}"
        )
    buf = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(buf, np.int32, n_seq, HEADER_BYTES)
    pointers = np.frombuffer(buf, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)
    docs = np.frombuffer(buf, np.int64, n_doc, HEADER_BYTES + 12 * n_seq)
    if n_doc == 0 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
        raise ConfigError(f"{idx} is inconsistent: its document indices do not run from 0 to its {n_seq} sequences")
    n_tokens = _check_contiguous(idx, lengths, pointers, dtype.itemsize)
    bin_size = os.path.getsize(bin_)
    if bin_size != n_tokens * dtype.itemsize:
        problem = "is truncated:" if bin_size < n_tokens * dtype.itemsize else "does not belong to its index:"
        raise ConfigError(
            f"{bin_} {problem} {bin_size} bytes, {idx} describes {n_tokens} {dtype.name} tokens "
            f"({n_tokens * dtype.itemsize} bytes)"
        )
    if n_tokens == 0:
        raise ConfigError(f"{bin_} holds no tokens")
    tokens = np.memmap(bin_, mode="r", dtype=dtype, shape=(n_tokens,))
    return IndexedFile(prefix, dtype, lengths, pointers, docs, tokens)


def _check_contiguous(idx: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """The total tokens, checking (in chunks) that each sequence starts where the one before ends,
    as Megatron's writer lays them out."""
    offset = 0
    for lo in range(0, len(lengths), _CHUNK):
        n = lengths[lo : lo + _CHUNK].astype(np.int64)
        if np.any(n < 0):
            raise ConfigError(f"{idx} is inconsistent: a sequence length is negative")
        starts = offset + np.concatenate([[0], np.cumsum(n)[:-1]])
        if not np.array_equal(pointers[lo : lo + _CHUNK], starts * itemsize):
            raise ConfigError(
                f"{idx}: the sequences are not stored back to back (pointer != the lengths before it), "
                "as Megatron's writer stores them"
            )
        offset += int(n.sum())
    return offset


def write_indexed(prefix: str, documents: Iterable[Sequence[np.ndarray]], dtype) -> tuple[int, int]:
    """Writes PREFIX.bin and PREFIX.idx as Megatron's `IndexedDatasetBuilder` does.

    Each document is a list of sequences (`add_document(tokens, lengths)`: one sequence per document,
    as preprocess_data without --split-sentences writes). Returns (documents, tokens) written. Both files
    are written under temporary names beside them and renamed into place at the end (removed on a
    failure), so a failed write leaves no partial .bin or mismatched .idx.

    Raises:
      ConfigError: PREFIX.bin or PREFIX.idx exists (never overwritten), or a token id does not fit `dtype`.
    """
    dtype = np.dtype(dtype)
    paths = (f"{prefix}.bin", f"{prefix}.idx")
    for path in paths:
        if os.path.lexists(path):
            raise ConfigError(
                f"{path} exists: jzero never overwrites a file it did not write; move it away or choose another prefix"
            )
    tmp_bin, tmp_idx = (f"{path}.{os.getpid()}.tmp" for path in paths)
    lengths: list[int] = []
    doc_indices = [0]
    made: list[str] = []  # the temporaries this call created: only they are removed on a failure
    try:
        with open(tmp_bin, "xb") as data:
            made.append(tmp_bin)
            for doc in documents:
                arrays = [np.asarray(s) for s in doc]
                for a in arrays:
                    if a.size and (a.min() < np.iinfo(dtype).min or a.max() > np.iinfo(dtype).max):
                        raise ConfigError(f"{prefix}.bin: token ids {a.min()}..{a.max()} do not fit {dtype.name}")
                data.write(np.concatenate(arrays).astype(dtype).tobytes(order="C") if arrays else b"")
                lengths.extend(a.size for a in arrays)
                doc_indices.append(len(lengths))
        pointers = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))[:-1]]) * dtype.itemsize
        with open(tmp_idx, "xb") as f:
            made.append(tmp_idx)
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", dtype_code(dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_indices)))
            f.write(np.array(lengths, np.int32).tobytes(order="C"))
            f.write(np.array(pointers[: len(lengths)], np.int64).tobytes(order="C"))
            f.write(np.array(doc_indices, np.int64).tobytes(order="C"))
        os.replace(tmp_bin, paths[0])
        try:
            os.replace(tmp_idx, paths[1])
        except BaseException:
            os.unlink(paths[0])  # the .bin this call just put there: never a .bin without its .idx
            raise
    except BaseException:
        for tmp in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    return len(doc_indices) - 1, int(sum(lengths))
