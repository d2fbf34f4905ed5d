"""Megatron-LM's distributed-optimizer checkpoint format: its files, and the flat buffer's layout in them.

Megatron saves the optimizer's state as its flat buffer (docs/megatron.md, "The flat buffer"):
params in reverse registration order, starts aligned to 64 elements, buckets padded for the DP
size. The files keep that layout with the bucket-end padding cut out, so a bucket is known by
its unpadded size alone (`layout_bucket_numels`) and a param by its (bucket, start) in it
(`bucket_positions`), for any DP size. Reading is `jzero.interop.megatron_read`'s, writing
`jzero.interop.megatron_save`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jzero.interop import InteropError
from jzero.zero.flat.buffers import build_layout

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE, OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
EXTRA_STATE = "_extra_state"  # Megatron's per-module extra state (None for its local layers)
MOMENTS = ("exp_avg", "exp_avg_sq")


def refuse_to_overwrite(out: Path, iteration: int | None, name: str = "directory") -> None:
    """InteropError where `out` (called `name`) holds a Megatron tracker, another run's (Megatron would load
    jzero's iteration instead of its own), or, with `iteration`, its `iter_N` folder: jzero never overwrites
    either. The export asks before any work and again as it writes (one that appeared meanwhile)."""
    tracker = out / TRACKER
    if tracker.exists() or tracker.is_symlink():
        raise InteropError(f"{tracker} exists: jzero never overwrites a checkpoint's tracker; choose another directory")
    folder = out / f"iter_{iteration:07d}" if iteration is not None else None
    if folder is not None and (folder.exists() or folder.is_symlink()):
        raise InteropError(
            f"{folder} exists: jzero never overwrites a checkpoint; move it away or choose another {name}"
        )


def bucket_positions(numels: Sequence[int], bucket_numels: Sequence[int], where: str) -> list[tuple[int, int]]:
    """Per param (registration order), (its bucket, its start in the bucket), for buckets of the given
    unpadded sizes: Megatron's walk in reverse registration order, starts aligned to 64, a bucket
    closing where its recorded size ends (`buffers.build_layout`), or at an aligned start where a
    shared embedding (tied, under pipeline parallelism) opens a bucket of its own. Raises
    InteropError if the params do not fill the buckets so."""
    out: list = [None] * len(numels)
    b, cursor = 0, 0
    for i in reversed(range(len(numels))):
        if b >= len(bucket_numels):
            raise InteropError(f"{where}: its {len(bucket_numels)} buckets end before the params do")
        cursor = -(-cursor // 64) * 64
        if 0 < cursor == bucket_numels[b] and numels[i]:  # closed before a shared embedding
            b, cursor = b + 1, 0
            if b >= len(bucket_numels):
                raise InteropError(f"{where}: its {len(bucket_numels)} buckets end before the params do")
        end = cursor + numels[i]
        if end > bucket_numels[b]:
            raise InteropError(
                f"{where}: the params do not fill its buckets of {list(bucket_numels)} elements in Megatron's "
                "layout (another model, or another param order?)"
            )
        out[i] = (b, cursor)
        cursor = end
        if end == bucket_numels[b]:
            b, cursor = b + 1, 0
    if b != len(bucket_numels):
        raise InteropError(f"{where}: the params end inside bucket {b} of {list(bucket_numels)}")
    return out


def layout_bucket_numels(
    numels: Sequence[int], bucket_size: int | None, new_bucket: Sequence[bool] | None = None
) -> tuple[int, ...]:
    """Megatron's per-bucket unpadded sizes for params of `numels` (registration order) and
    `--ddp-bucket-size` (None: one bucket); they do not depend on the DP size. `new_bucket`: per param,
    True for a shared embedding (its own bucket)."""
    layout = build_layout(list(numels), dp_size=1, bucket_size=bucket_size, new_bucket=new_bucket)
    return layout.per_bucket_numel_unpadded
