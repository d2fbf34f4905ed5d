"""Megatron-Core's flat grad/param buffer layout and distributed-optimizer ownership.

Pure index arithmetic, no arrays: given the element counts of the params that share
one buffer (one (param dtype, grad dtype, is_expert) key in Megatron), compute

- where each param lives in the flat buffer (``param_index_map``),
- how the buffer is cut into buckets (``bucket_indices``), and
- which contiguous shard of each bucket a data-parallel rank owns, with the four
  ranges of ``DistributedOptimizer._build_model_gbuf_param_range_map``.

Mirrors ``_ParamAndGradBuffer`` / ``DistributedOptimizer._compute_per_buffer_param_layout``
with ``use_distributed_optimizer=True``. All ranges are half-open ``[start, end)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

# Params start on 128-byte boundaries (64 elements of a >= 16-bit dtype).
PARAM_START_ALIGNMENT = 64


@dataclass(frozen=True)
class Range:
    """A half-open index range ``[start, end)``, as Megatron's ``Range``."""

    start: int
    end: int

    def __post_init__(self):
        if self.end < self.start:
            raise ValueError(f"Range end {self.end} < start {self.start}")

    @property
    def size(self) -> int:
        return self.end - self.start

    def __len__(self) -> int:
        return self.size

    def normalize(self, start: int = 0) -> Range:
        """The same-sized range shifted to begin at ``start``."""
        return Range(start, start + self.size)


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def bucket_end_divisor(dp_size: int, pad_for_high_nccl_busbw: bool = False) -> int:
    """Multiple every bucket end is padded to.

    ``dp_size`` so each bucket splits into equal shards; 128 so every bucket starts
    256-byte aligned (cuBLAS/TE); ``2**16`` because NCCL ring busbw drops unless the
    per-rank message is a multiple of a large power of two.
    """
    if pad_for_high_nccl_busbw:
        return math.lcm(dp_size, 128, 2**16)
    return math.lcm(dp_size, 128)


ParamRanges = dict[str, Range]  # keys: gbuf_world, gbuf_world_in_bucket, gbuf_local, param


@dataclass(frozen=True)
class Layout:
    """One flat buffer: param placement, buckets, and per-rank ownership.

    Sequences are tuples so a ``Layout`` is hashable (usable as a jit static arg).

    Attributes:
        dp_size: Data-parallel group size the buckets are sharded over.
        bucket_size: Requested elements per bucket (``None``: a single bucket).
        pad_for_high_nccl_busbw: Megatron's ``pad_buckets_for_high_nccl_busbw``.
        param_index_map: Per param, in the GIVEN (registration) order,
            ``(start, end, bucket_id)`` in the buffer; ``end - start == numel``.
        bucket_indices: Per bucket, in buffer order, padded ``(start, end)``.
        per_bucket_numel_unpadded: Per bucket, last param end minus bucket start
            (includes the 64-element alignment gaps, not the end padding).
        bucket_params: Per bucket, the indices (given order) of its params, in
            buffer order (i.e. backprop order).
    """

    dp_size: int
    bucket_size: int | None
    pad_for_high_nccl_busbw: bool
    param_index_map: tuple[tuple[int, int, int], ...]
    bucket_indices: tuple[tuple[int, int], ...]
    per_bucket_numel_unpadded: tuple[int, ...]
    bucket_params: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        """Total buffer size, padding included."""
        return self.bucket_indices[-1][1]

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_indices)

    def shard_size(self, bucket_id: int) -> int:
        """Elements each rank owns of bucket ``bucket_id`` (Megatron's max_gbuf_range_size)."""
        start, end = self.bucket_indices[bucket_id]
        return (end - start) // self.dp_size

    def gbuf_world_range(self, bucket_id: int, rank: int) -> Range:
        """Rank ``rank``'s shard of bucket ``bucket_id``, in whole-buffer coordinates."""
        self._check_rank(rank)
        offset = self.bucket_indices[bucket_id][0]
        size = self.shard_size(bucket_id)
        return Range(offset + rank * size, offset + (rank + 1) * size)

    def owned(self, rank: int) -> list[dict[int, ParamRanges]]:
        """Per bucket, ``{param_idx: ranges}`` for every param overlapping ``rank``'s shard.

        Ownership ignores param boundaries, so a param may be split across ranks;
        ``ranges["param"]`` is then the slice of the flattened param this rank owns.
        Keys are given-order param indices, iterated in buffer order.
        """
        return [
            _build_param_range_map(
                {i: self.param_index_map[i] for i in self.bucket_params[b]},
                self.gbuf_world_range(b, rank),
                bucket_offset=self.bucket_indices[b][0],
            )
            for b in range(self.num_buckets)
        ]

    def owned_numel(self, rank: int) -> int:
        """Elements of real params (padding excluded) ``rank`` owns, over all buckets."""
        return sum(r["param"].size for bucket in self.owned(rank) for r in bucket.values())

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank must be in [0, {self.dp_size}), got {rank}")


def _build_param_range_map(
    param_world_index_map: dict[int, tuple[int, int, int]],
    gbuf_world_range: Range,
    bucket_offset: int,
) -> dict[int, ParamRanges]:
    """Megatron's ``_build_model_gbuf_param_range_map`` for one rank and bucket.

    For each param overlapping the rank's shard ``gbuf_world_range``, four ranges:
    ``gbuf_world`` (whole buffer), ``gbuf_world_in_bucket`` (minus bucket offset),
    ``gbuf_local`` (inside the rank's shard) and ``param`` (inside the flat param).
    """
    param_range_map = {}
    for idx, (param_world_start, param_world_end, _) in param_world_index_map.items():
        local_start = max(0, param_world_start - gbuf_world_range.start)
        local_end = min(gbuf_world_range.size, param_world_end - gbuf_world_range.start)
        if local_end <= local_start:
            continue
        gbuf_local = Range(local_start, local_end)
        gbuf_world = gbuf_local.normalize(local_start + gbuf_world_range.start)
        param_range_map[idx] = {
            "gbuf_world": gbuf_world,
            "gbuf_world_in_bucket": Range(
                gbuf_world.start - bucket_offset, gbuf_world.end - bucket_offset
            ),
            "gbuf_local": gbuf_local,
            "param": gbuf_local.normalize(max(0, gbuf_world_range.start - param_world_start)),
        }
    return param_range_map


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _check_layout_args(numels: list, dp_size, bucket_size, new_bucket: list[bool]) -> None:
    if not numels:
        raise ValueError("numels must be non-empty")
    for i, n in enumerate(numels):
        if not _is_int(n) or n < 0:
            raise ValueError(f"numels[{i}] must be an int >= 0, got {n!r}")
    if not _is_int(dp_size) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if bucket_size is not None and (not _is_int(bucket_size) or bucket_size < 1):
        raise ValueError(f"bucket_size must be None or an int >= 1, got {bucket_size!r}")
    if len(new_bucket) != len(numels):
        raise ValueError(f"new_bucket has {len(new_bucket)} flags but there are {len(numels)} params")


def build_layout(
    numels: Sequence[int],
    dp_size: int,
    bucket_size: int | None = None,
    pad_for_high_nccl_busbw: bool = False,
    new_bucket: Sequence[bool] | None = None,
) -> Layout:
    """Lay params out in one flat buffer exactly as Megatron's distributed optimizer does.

    Arguments:
        numels: Element count of each param, in registration (forward) order. A param
            with no elements gets an aligned start and an empty range, as in Megatron,
            and no rank owns any of it.
        dp_size: Data-parallel group size; every bucket is padded to split evenly.
        bucket_size: Close a bucket once it holds at least this many elements
            (``None``: one bucket for the whole buffer).
        pad_for_high_nccl_busbw: Also pad bucket ends to a multiple of ``2**16 * ...``.
        new_bucket: Per param (given order), True for a shared embedding: it gets a
            bucket of its own so first and last pipeline stages shard it identically.

    Returns:
        The :class:`Layout`.
    """
    numels = list(numels)
    new_bucket = [False] * len(numels) if new_bucket is None else [bool(f) for f in new_bucket]
    _check_layout_args(numels, dp_size, bucket_size, new_bucket)
    divisor = bucket_end_divisor(dp_size, pad_for_high_nccl_busbw)
    param_index_map: list = [None] * len(numels)
    bucket_indices, per_bucket_numel_unpadded, bucket_params = [], [], []
    bucket_start = 0
    open_params: list[int] = []

    def close_bucket(param_end: int) -> int:
        """Record the open bucket as ending at ``param_end``; return its padded end."""
        nonlocal bucket_start, open_params
        per_bucket_numel_unpadded.append(param_end - bucket_start)
        bucket_end = _pad(param_end, divisor)
        bucket_indices.append((bucket_start, bucket_end))
        bucket_params.append(tuple(open_params))
        bucket_start, open_params = bucket_end, []
        return bucket_end

    cursor = 0
    # Reverse registration order ~ backprop order, so a bucket's grads are all ready
    # (and its reduce-scatter can start) while the rest of backward still runs.
    for idx in reversed(range(len(numels))):
        cursor = _pad(cursor, PARAM_START_ALIGNMENT)
        if new_bucket[idx] and open_params:
            # The shared embedding starts at the padded end of the bucket it closes,
            # never inside that bucket's padding (older Megatron got this wrong).
            cursor = close_bucket(cursor)
        param_end = cursor + numels[idx]
        param_index_map[idx] = (cursor, param_end, len(bucket_indices))
        open_params.append(idx)
        # The check counts alignment gaps too: Megatron compares buffer extents.
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or new_bucket[idx]:
            cursor = close_bucket(param_end)
        else:
            cursor = param_end
    if open_params:
        close_bucket(cursor)

    return Layout(
        dp_size=dp_size,
        bucket_size=bucket_size,
        pad_for_high_nccl_busbw=bool(pad_for_high_nccl_busbw),
        param_index_map=tuple(param_index_map),
        bucket_indices=tuple(bucket_indices),
        per_bucket_numel_unpadded=tuple(per_bucket_numel_unpadded),
        bucket_params=tuple(bucket_params),
    )
