"""Deterministic token batches: row r of step s depends only on (seed, s, r), so any
step can be reproduced (a resumed run sees exactly the batches it would have) and any
split of a step's rows gives the same global batch.

A step's global batch is numpy int32 `[global_batch, seq_len + 1]` (inputs + shifted
targets). `rows(step, start, stop)` makes only the rows `[start, stop)`: each process
reads the rows its own devices hold (`jzero.run.Run.device_batch`), and no
process materialises the whole global batch.

Real data is a token stream (`TokenData`): bytes of text files, a flat file of token ids
(nanoGPT's train.bin) or Megatron's indexed dataset (`jzero.train.indexed`), memory-mapped,
so a process reads only the rows it asks for. Validation data is a second stream
(`data.val_path`) or the held-out end of the first (`data.val_fraction`); docs/data.md.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from jzero.config import Config, ConfigError, DataKind
from jzero.train.indexed import read_indexed

MAX_TEXT_BYTES = 16 * 2**20  # plenty for tiny models; keeps start-up fast
TRAIN_STREAM, VAL_STREAM = 3, 4  # the generators of the offsets: (seed, stream, step)
SCAN_CHUNK = 1 << 24  # tokens per read of the vocabulary check: a file is never read whole


class Dataset:
    """A step's rows `[global_batch, seq_len + 1]`, row r a pure function of (seed, step, r)."""

    shape: tuple[int, int]  # [global_batch, seq_len + 1]

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows `[start, stop)` of `step`'s global batch: int32 `[stop - start, seq_len + 1]`."""
        raise NotImplementedError

    def batch(self, step: int) -> np.ndarray:
        """`step`'s whole global batch: int32 `[global_batch, seq_len + 1]`."""
        return self.rows(step, 0, self.shape[0])

    def _check_rows(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) are not within the global batch of {self.shape[0]}")


class SyntheticData(Dataset):
    """Sequences from a fixed, seeded random Markov chain over the vocabulary.

    The chain has a few likely successors per token, so the loss can fall well
    below log(vocab_size): a model that learns anything shows it. Each row draws from
    its own generator, seeded by (seed, step, row).
    """

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.shape = (global_batch, seq_len + 1)
        rng = np.random.default_rng([seed, 1])
        logits = rng.standard_normal((vocab_size, vocab_size)) * 3.0
        probs = np.exp(logits - logits.max(1, keepdims=True))
        self.cdf = np.cumsum(probs / probs.sum(1, keepdims=True), axis=1)
        self.vocab_size, self.seed = vocab_size, seed

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        self._check_rows(start, stop)
        t = self.shape[1]
        out = np.empty((stop - start, t), np.int32)
        u = np.empty((stop - start, t - 1))  # uniforms that pick each next token
        for i, row in enumerate(range(start, stop)):
            rng = np.random.default_rng([self.seed, 2, step, row])  # a generator per row: any split agrees
            out[i, 0] = rng.integers(0, self.vocab_size)
            u[i] = rng.random(t - 1)
        for i in range(1, t):  # all rows at once, one position at a time
            cdf = self.cdf[out[:, i - 1]]  # [rows, vocab]
            out[:, i] = np.minimum((cdf < u[:, i - 1, None]).sum(1), self.vocab_size - 1)
        return out


class TokenData(Dataset):
    """Windows of `seq_len + 1` consecutive tokens of a token stream (in memory or memory-mapped).

    Step s draws its global_batch window starts from the generator (seed, stream, s), uniform
    over the region `[lo, hi)` (no window crosses its ends), so rows of the training and the
    held-out region never overlap; only the requested rows' tokens are read. Validation data
    uses its own stream, with the evaluation's index for the step.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch: int,
        seed: int,
        region: tuple[int, int] | None = None,
        stream: int = TRAIN_STREAM,
        name: str = "the data",
        hint: str = "",
    ):
        self.tokens, self.seed, self.stream = tokens, seed, stream
        self.lo, self.hi = region if region is not None else (0, len(tokens))
        self.shape = (global_batch, seq_len + 1)
        if self.hi - self.lo < seq_len + 1:
            raise ConfigError(
                f"{name} holds {self.hi - self.lo} tokens, fewer than one sequence of model.seq_len + 1 = "
                f"{seq_len + 1}{hint}"
            )

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        self._check_rows(start, stop)
        rng = np.random.default_rng([self.seed, self.stream, step])
        b, t = self.shape
        offsets = rng.integers(self.lo, self.hi - t + 1, b)[start:stop]  # all b drawn: row r's is the r-th
        return self.tokens[offsets[:, None] + np.arange(t)].astype(np.int32)


TEXT_SUFFIXES = (".py", ".txt", ".md")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages vary by machine


def text_files(root: Path) -> list[Path]:
    """The `*.py` / `*.txt` / `*.md` files under `root` in sorted path order, installed packages excluded."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.suffix in TEXT_SUFFIXES and p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts)
    )


def read_text(path: str | None, key: str = "data.path") -> np.ndarray:
    """Byte tokens, uint8 `[N]`: the text files under `path` (None = the installed Python stdlib, the same
    on every machine) as one stream, at most MAX_TEXT_BYTES."""
    root = Path(path) if path is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"{key}={str(root)!r} is not a directory")
    chunks, total = [], 0
    for f in text_files(root):
        chunks.append(f.read_bytes())
        total += len(chunks[-1])
        if total >= MAX_TEXT_BYTES:
            break
    return np.frombuffer(b"".join(chunks), np.uint8)[:MAX_TEXT_BYTES]


def read_token_file(path: str, dtype: str, key: str = "data.path") -> np.ndarray:
    """nanoGPT's format: a flat file of `dtype` token ids, memory-mapped `[N]`."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"{key}={path!r} does not exist" if not os.path.exists(path) else f"{key}={path!r} is not a file"
        )
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % itemsize:
        raise ConfigError(f"{path} is truncated: {size} bytes is not a whole number of {dtype} tokens")
    if size == 0:
        raise ConfigError(f"{path} holds no tokens")
    return np.memmap(path, mode="r", dtype=dtype, shape=(size // itemsize,))


def check_vocab(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Every id of `tokens` is in [0, vocab_size) (read in chunks; skipped where the dtype cannot exceed it).

    Raises:
      ConfigError: naming the largest id and the vocabulary it needs.
    """
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return
    top, bottom = 0, 0
    for lo in range(0, len(tokens), SCAN_CHUNK):
        chunk = tokens[lo : lo + SCAN_CHUNK]
        top, bottom = max(top, int(chunk.max())), min(bottom, int(chunk.min()))
    if bottom < 0:
        raise ConfigError(f"{what} holds a negative token id ({bottom})")
    if top >= vocab_size:
        raise ConfigError(
            f"{what} holds token id {top} but model.vocab_size={vocab_size}: set model.vocab_size to at least {top + 1}"
        )


def held_out_split(n_tokens: int, fraction: float, boundaries: np.ndarray | None = None) -> int:
    """Where the held-out last `fraction` of a stream of `n_tokens` starts: at the interior document
    boundary nearest to `(1 - fraction) * n_tokens` (Megatron splits by documents) if that holds out
    between half and twice `fraction`, else (no boundary near: a few long documents) at that token."""
    target = round((1 - fraction) * n_tokens)
    if boundaries is not None:
        interior = boundaries[(boundaries > 0) & (boundaries < n_tokens)]
        if len(interior):
            nearest = int(interior[np.argmin(np.abs(interior - target))])
            if fraction / 2 <= (n_tokens - nearest) / n_tokens <= 2 * fraction:
                return nearest
    return target


def _read(cfg: Config, path: str | None, key: str) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(tokens, document starts or None, a name for errors) of the source at `path`."""
    d = cfg.data
    if d.kind == DataKind.TEXT:
        tokens = read_text(path, key)
        return tokens, None, f"{key}={path!r} (text)"
    if d.kind == DataKind.TOKENS:
        tokens, starts = read_token_file(path, d.dtype.value, key), None
    else:
        indexed = read_indexed(path, key)
        tokens, starts = indexed.tokens, indexed.document_starts()
    check_vocab(tokens, cfg.model.vocab_size, f"{key}={path!r}")
    return tokens, starts, f"{key}={path!r}"


def data_identity(cfg: Config) -> dict:
    """What fixes the stream of batches besides the step: saved with each checkpoint, compared on resume."""
    d = cfg.data
    return {
        "kind": d.kind.value, "seed": cfg.train.seed, "path": d.path, "dtype": d.dtype.value,
        "val_path": d.val_path, "val_fraction": d.val_fraction,
    }  # fmt: skip


def make_datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """The training data and the validation data (None: synthetic data, or `data.val_fraction: 0` and no
    `data.val_path`). Both give global batches `[train.global_batch, model.seq_len + 1]`."""
    m, t, d = cfg.model, cfg.train, cfg.data
    if d.kind == DataKind.SYNTHETIC:
        return SyntheticData(m.vocab_size, m.seq_len, t.global_batch, t.seed), None
    args = (m.seq_len, t.global_batch, t.seed)
    tokens, starts, name = _read(cfg, d.path, "data.path")
    if d.val_path is not None:
        val_tokens, _, val_name = _read(cfg, d.val_path, "data.val_path")
        return TokenData(tokens, *args, name=name), TokenData(val_tokens, *args, stream=VAL_STREAM, name=val_name)
    if d.val_fraction == 0:
        return TokenData(tokens, *args, name=name), None
    split = held_out_split(len(tokens), d.val_fraction, starts)
    part = f"{name} less its held-out data.val_fraction={d.val_fraction}"
    train = TokenData(tokens, *args, region=(0, split), name=part)
    held_out = f"the held-out data.val_fraction={d.val_fraction} of {name}"
    hint = "; raise data.val_fraction or set data.val_path"
    return train, TokenData(tokens, *args, region=(split, len(tokens)), stream=VAL_STREAM, name=held_out, hint=hint)


def make_dataset(cfg: Config) -> Dataset:
    """The training data of `make_datasets`."""
    return make_datasets(cfg)[0]
