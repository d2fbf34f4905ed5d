"""Megatron-LM's indexed-dataset writer, transcribed step by step without torch, and the fixtures it wrote.

The classes below follow `megatron/core/datasets/indexed_dataset.py` (NVIDIA/Megatron-LM):
`DType`, `_IndexWriter` and `IndexedDatasetBuilder` (add_item, end_document, add_document,
finalize), with `torch.Tensor` arguments replaced by numpy arrays. They are kept apart from
jzero's own writer (`jzero.train.indexed.write_indexed`) so the tests check jzero's reader and
writer against an independent copy of Megatron's code. `python tests/helpers/megatron_writer.py`
writes the fixtures in tests/data/ again (they are committed: a few hundred bytes).
"""

from __future__ import annotations

import struct
from enum import Enum
from pathlib import Path

import numpy

_INDEX_HEADER = b"MMIDIDX\x00\x00"
DATA = Path(__file__).resolve().parents[1] / "data"

# Documents as lists of sequences (preprocess_data's sentences), ids that need each dtype.
DOCUMENTS = {
    "uint16": [[[1, 2, 3, 4, 5]], [[60000, 7], [8, 9, 10]], [[65535, 0, 11]]],
    "int32": [[[70000, 1, 2]], [[3], [4, 100000, 5]], [[2**31 - 1]]],
}


class DType(Enum):
    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value) -> int:
        return cls[value.__name__].value

    @staticmethod
    def size(key) -> int:
        if isinstance(key, int):
            return getattr(numpy, DType(key).name)().itemsize
        return key().itemsize


class _IndexWriter:
    def __init__(self, idx_path: str, dtype) -> None:
        self.idx_path = idx_path
        self.dtype = dtype

    def __enter__(self):
        self.idx_writer = open(self.idx_path, "wb")
        self.idx_writer.write(_INDEX_HEADER)
        self.idx_writer.write(struct.pack("<Q", 1))
        self.idx_writer.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
        return self

    def __exit__(self, *exc) -> None:
        self.idx_writer.close()

    def write(self, sequence_lengths, sequence_modes, document_indices) -> None:
        sequence_pointers = self._sequence_pointers(sequence_lengths)
        sequence_count = len(sequence_lengths)
        self.idx_writer.write(struct.pack("<Q", sequence_count))
        document_count = len(document_indices)
        self.idx_writer.write(struct.pack("<Q", document_count))
        self.idx_writer.write(numpy.array(sequence_lengths, dtype=numpy.int32).tobytes(order="C"))
        self.idx_writer.write(numpy.array(sequence_pointers, dtype=numpy.int64).tobytes(order="C"))
        self.idx_writer.write(numpy.array(document_indices, dtype=numpy.int64).tobytes(order="C"))
        if sequence_modes is not None:
            self.idx_writer.write(numpy.array(sequence_modes, dtype=numpy.int8).tobytes(order="C"))

    def _sequence_pointers(self, sequence_lengths):
        itemsize = numpy.int64(DType.size(self.dtype))
        curr_ptr = numpy.int64(0)
        list_ptr = []
        for length in sequence_lengths:
            list_ptr.append(curr_ptr.item())
            curr_ptr += length * itemsize
        return list_ptr


class IndexedDatasetBuilder:
    def __init__(self, bin_path: str, dtype=numpy.int32, multimodal: bool = False) -> None:
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.multimodal = multimodal
        self.sequence_lengths = []
        self.document_indices = [0]
        self.sequence_modes = [] if self.multimodal else None

    def add_item(self, array, mode: int = 0) -> None:
        np_array = numpy.array(array, dtype=self.dtype)
        self.data_file.write(np_array.tobytes(order="C"))
        self.sequence_lengths.append(np_array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, array, lengths, modes=None) -> None:
        np_array = numpy.array(array, dtype=self.dtype)
        self.data_file.write(np_array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        with _IndexWriter(idx_path, self.dtype) as writer:
            writer.write(self.sequence_lengths, self.sequence_modes, self.document_indices)


def write_fixture(prefix: str, documents, dtype) -> None:
    """As tools/preprocess_data.py does: one `add_document(ids, sentence_lens)` per document."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_document([t for sentence in doc for t in sentence], [len(s) for s in doc])
    builder.finalize(f"{prefix}.idx")


if __name__ == "__main__":
    DATA.mkdir(exist_ok=True)
    for name, docs in DOCUMENTS.items():
        write_fixture(str(DATA / f"megatron_{name}"), docs, getattr(numpy, name))
