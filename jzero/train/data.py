"""Deterministic token batches: row r of step s depends only on (seed, s, r), so any
step can be reproduced (a resumed run sees exactly the batches it would have) and any
split of a step's rows gives the same global batch.

A step's global batch is numpy int32 `[global_batch, seq_len + 1]` (inputs + shifted
targets). `rows(step, start, stop)` makes only the rows `[start, stop)`: each process
reads the rows its own devices hold (`jzero.train.loop.Run.device_batch`), and no
process materialises the whole global batch.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from jzero.config import Config, ConfigError, DataKind

MAX_TEXT_BYTES = 16 * 2**20  # plenty for tiny models; keeps start-up fast


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


class TextData(Dataset):
    """Byte-level tokens from every `*.py` / `*.txt` / `*.md` file under a directory
    (installed packages excluded, so the default stdlib text is the same on every machine).

    Files are read in sorted path order into one byte stream; each sequence starts
    at an offset drawn from (seed, step): the step's generator draws all global_batch
    offsets (cheap ints), and only the requested rows' tokens are gathered.
    """

    SUFFIXES = (".py", ".txt", ".md")
    SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages vary by machine

    def __init__(self, path: str | None, seq_len: int, global_batch: int, seed: int):
        root = Path(path) if path is not None else Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise ConfigError(f"data.path={str(root)!r} is not a directory")
        chunks, total = [], 0
        files = sorted(
            p
            for p in root.rglob("*")
            if p.suffix in self.SUFFIXES and p.is_file() and not self.SKIP_DIRS & set(p.relative_to(root).parts)
        )
        for f in files:
            data = f.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= MAX_TEXT_BYTES:
                break
        self.tokens = np.frombuffer(b"".join(chunks), np.uint8)[:MAX_TEXT_BYTES]
        self.shape = (global_batch, seq_len + 1)
        if len(self.tokens) < 2 * (seq_len + 1):
            raise ConfigError(f"data.path={str(root)!r} holds only {len(self.tokens)} bytes of text")
        self.seed = seed

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        self._check_rows(start, stop)
        rng = np.random.default_rng([self.seed, 3, step])
        b, t = self.shape
        offsets = rng.integers(0, len(self.tokens) - t, b)[start:stop]  # all b drawn: row r's is the r-th
        return self.tokens[offsets[:, None] + np.arange(t)].astype(np.int32)


def make_dataset(cfg: Config) -> Dataset:
    m, t = cfg.model, cfg.train
    if cfg.data.kind == DataKind.SYNTHETIC:
        return SyntheticData(m.vocab_size, m.seq_len, t.global_batch, t.seed)
    return TextData(cfg.data.path, m.seq_len, t.global_batch, t.seed)
