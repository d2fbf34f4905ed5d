"""Deterministic token batches: `batch(step)` depends only on (seed, step), so any
step can be reproduced (and a resumed run sees exactly the batches it would have).

Batches are numpy int32 `[global_batch, seq_len + 1]` (inputs + shifted targets);
the caller places them on the mesh split over the data-parallel domain.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from jzero.config import Config, ConfigError, DataKind

MAX_TEXT_BYTES = 16 * 2**20  # plenty for tiny models; keeps start-up fast


class SyntheticData:
    """Sequences from a fixed, seeded random Markov chain over the vocabulary.

    The chain has a few likely successors per token, so the loss can fall well
    below log(vocab_size): a model that learns anything shows it.
    """

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.shape = (global_batch, seq_len + 1)
        rng = np.random.default_rng([seed, 1])
        logits = rng.standard_normal((vocab_size, vocab_size)) * 3.0
        probs = np.exp(logits - logits.max(1, keepdims=True))
        self.cdf = np.cumsum(probs / probs.sum(1, keepdims=True), axis=1)
        self.vocab_size, self.seed = vocab_size, seed

    def batch(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 2, step])
        b, t = self.shape
        out = np.empty(self.shape, np.int32)
        out[:, 0] = rng.integers(0, self.vocab_size, b)
        u = rng.random((b, t))
        for i in range(1, t):
            rows = self.cdf[out[:, i - 1]]
            out[:, i] = np.minimum((rows < u[:, i, None]).sum(1), self.vocab_size - 1)
        return out


class TextData:
    """Byte-level tokens from every `*.py` / `*.txt` / `*.md` file under a directory
    (installed packages excluded, so the default stdlib text is the same on every machine).

    Files are read in sorted path order into one byte stream; each sequence starts
    at an offset drawn from (seed, step).
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

    def batch(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 3, step])
        b, t = self.shape
        starts = rng.integers(0, len(self.tokens) - t, b)
        return self.tokens[starts[:, None] + np.arange(t)].astype(np.int32)


def make_dataset(cfg: Config) -> SyntheticData | TextData:
    m, t = cfg.model, cfg.train
    if cfg.data.kind == DataKind.SYNTHETIC:
        return SyntheticData(m.vocab_size, m.seq_len, t.global_batch, t.seed)
    return TextData(cfg.data.path, m.seq_len, t.global_batch, t.seed)
