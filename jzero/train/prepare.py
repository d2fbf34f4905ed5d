"""`jzero data prepare SRC_DIR OUT_PREFIX`: text files -> Megatron's indexed dataset (OUT_PREFIX.bin/.idx).

What Megatron's `tools/preprocess_data.py` writes, from a directory of text instead of JSON lines:
each `*.py` / `*.txt` / `*.md` file under SRC_DIR (sorted by path, installed packages skipped, as
`data.kind: text` reads them) is one document of one sequence; a file whose text gives no token (an
empty file) is a document of no sequence, as preprocess_data.py skips a text that tokenizes to
nothing. Its tokens are its bytes (ids 0..255), or with `--tokenizer tokenizer.json` the ids a
Hugging Face `tokenizers` file gives its UTF-8 text (the optional extra `pip install 'jzero[data]'`;
the file is read from the path given, nothing is downloaded). The ids are stored as Megatron's
`DType.optimal_dtype` picks: uint16 for a vocabulary below 65500, else int32. Documents are written
one at a time, never all in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from jzero.errors import ConfigError, one_line
from jzero.paths import nearest_existing
from jzero.train.data import text_files
from jzero.train.indexed import optimal_dtype, write_indexed

BYTE_VOCAB = 256


def load_tokenizer(path: str) -> tuple[Callable[[bytes], list[int]], int]:
    """(encode: file bytes -> ids, vocabulary size) of a `tokenizers` JSON file.

    Raises:
      ConfigError: the package is not installed, or `path` is missing or not a tokenizer file.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "--tokenizer needs the Hugging Face `tokenizers` package: pip install 'jzero[data]'"
        ) from None
    if not os.path.isfile(path):
        raise ConfigError(f"--tokenizer {path} does not exist")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the Rust library's errors have no common Python type
        raise ConfigError(f"--tokenizer {path} is not a tokenizers JSON file ({one_line(e)})") from None

    def encode(data: bytes) -> list[int]:
        return tok.encode(data.decode("utf-8", errors="replace")).ids

    return encode, tok.get_vocab_size(with_added_tokens=True)


def prepare(src: str, out_prefix: str, tokenizer: str | None = None) -> dict:
    """Writes OUT_PREFIX.bin and OUT_PREFIX.idx from the text files under `src` (module docstring).

    Returns:
      {"documents", "tokens", "dtype", "vocab_size", "prefix"}.
    Raises:
      ConfigError: `src` is not a directory or holds no text file, a bad `tokenizer`, an `out_prefix` that
        names no file (empty, or ending in /), or OUT_PREFIX.bin or .idx exists (never overwritten).
    """
    if os.path.basename(out_prefix) in ("", ".", ".."):
        raise ConfigError(
            f"OUT_PREFIX {out_prefix!r} names no file: give a path prefix such as data/mine "
            "(it writes data/mine.bin + data/mine.idx)"
        )
    existing, what = nearest_existing(Path(out_prefix).parent)
    if what is not None:
        raise ConfigError(f"OUT_PREFIX {out_prefix}: {existing} is {what}")
    root = Path(src)
    if not root.is_dir():
        raise ConfigError(f"SRC_DIR {src} is not a directory")
    files = text_files(root)
    if not files:
        raise ConfigError(f"SRC_DIR {src} holds no *.py, *.txt or *.md file")
    if tokenizer is None:
        encode, vocab_size = (lambda data: np.frombuffer(data, np.uint8)), BYTE_VOCAB
    else:
        encode, vocab_size = load_tokenizer(tokenizer)
    dtype = np.dtype(optimal_dtype(vocab_size))

    def documents() -> Iterator[list[np.ndarray]]:
        for f in files:
            ids = np.asarray(encode(f.read_bytes()), np.int64)
            yield [ids] if ids.size else []  # an empty text: a document of no sequence, as Megatron writes it

    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    n_docs, n_tokens = write_indexed(out_prefix, documents(), dtype)
    return {
        "documents": n_docs,
        "tokens": n_tokens,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "prefix": out_prefix,
    }
