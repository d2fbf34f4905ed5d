"""Megatron flat-buffer layout and distributed-optimizer ownership (jzero.zero.flat.buffers)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jzero.zero.flat.buffers import Layout, Range, bucket_end_divisor, build_layout


def test_range():
    r = Range(3, 10)
    assert (r.start, r.end, r.size, len(r)) == (3, 10, 7, 7)
    assert r.normalize() == Range(0, 7)
    assert r.normalize(100) == Range(100, 107)
    with pytest.raises(ValueError):
        Range(5, 4)


def test_facts_worked_example():
    # docs/megatron.md, "The flat buffer": reversed placement, 64-aligned starts, one bucket padded to 128.
    lay = build_layout([2000, 5000, 3000], dp_size=4)
    assert isinstance(lay, Layout)
    assert lay.param_index_map == ((8064, 10064, 0), (3008, 8008, 0), (0, 3000, 0))
    assert lay.bucket_indices == ((0, 10112),)
    assert lay.numel == 10112
    assert lay.shard_size(0) == 2528
    assert lay.bucket_params == ((2, 1, 0),)

    # Rank 1 owns [2528, 5056): the tail of param 2 and the head of param 1.
    (rank1,) = lay.owned(1)
    assert list(rank1) == [2, 1]
    assert rank1[2] == {
        "gbuf_world": Range(2528, 3000),
        "gbuf_world_in_bucket": Range(2528, 3000),
        "gbuf_local": Range(0, 472),
        "param": Range(2528, 3000),
    }
    assert rank1[1] == {
        "gbuf_world": Range(3008, 5056),
        "gbuf_world_in_bucket": Range(3008, 5056),
        "gbuf_local": Range(480, 2528),
        "param": Range(0, 2048),
    }
    # Rank 3 owns [7584, 10112): the tail of param 1, all of param 0, then padding.
    (rank3,) = lay.owned(3)
    assert rank3[1]["param"] == Range(4576, 5000)
    assert rank3[1]["gbuf_local"] == Range(0, 424)
    assert rank3[0] == {
        "gbuf_world": Range(8064, 10064),
        "gbuf_world_in_bucket": Range(8064, 10064),
        "gbuf_local": Range(480, 2480),
        "param": Range(0, 2000),
    }
    assert [lay.owned_numel(r) for r in range(4)] == [2528, 2520, 2528, 2424]


def test_bucket_closes_on_last_param_no_empty_bucket():
    # dp 2 -> divisor 128. 300 >= 250 closes bucket 0 at pad(300)=384; then
    # 740 - 384 >= 250 closes bucket 1 on the last param: no trailing empty bucket.
    lay = build_layout([100, 200, 300], dp_size=2, bucket_size=250)
    assert lay.param_index_map == ((640, 740, 1), (384, 584, 1), (0, 300, 0))
    assert lay.bucket_indices == ((0, 384), (384, 768))
    assert lay.per_bucket_numel_unpadded == (300, 356)
    (b0, b1) = lay.owned(1)
    assert b1[0]["gbuf_world_in_bucket"] == Range(256, 356)
    assert b1[0]["gbuf_world"] == Range(640, 740)


def test_shared_embedding_gets_own_bucket():
    # dp 3 -> divisor lcm(3, 128) = 384. The flagged param closes the open bucket
    # at its 64-aligned start (192 -> padded 384) and starts at that padded end.
    lay = build_layout([1000, 50, 70], dp_size=3, new_bucket=[True, False, False])
    assert lay.param_index_map == ((384, 1384, 1), (128, 178, 0), (0, 70, 0))
    assert lay.bucket_indices == ((0, 384), (384, 1536))
    assert lay.per_bucket_numel_unpadded == (192, 1000)
    # Flagged param first in buffer order: no empty bucket before it.
    lay = build_layout([50, 1000], dp_size=3, new_bucket=[False, True])
    assert lay.bucket_indices == ((0, 1152), (1152, 1536))
    assert lay.bucket_params == ((1,), (0,))


def test_high_nccl_busbw_padding():
    lay = build_layout([10], dp_size=6, pad_for_high_nccl_busbw=True)
    assert lay.numel == math.lcm(6, 128, 2**16) == bucket_end_divisor(6, True)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(numels=[], dp_size=2),
        dict(numels=[-3], dp_size=2),
        dict(numels=[2.5], dp_size=2),
        dict(numels=[True], dp_size=2),
        dict(numels=[4], dp_size=0),
        dict(numels=[4], dp_size=2, bucket_size=0),
        dict(numels=[4, 5], dp_size=2, new_bucket=[True]),
    ],
)
def test_rejects_bad_inputs(kwargs):
    with pytest.raises(ValueError):
        build_layout(**kwargs)


def test_param_with_no_elements_is_laid_out_as_megatron_does():
    # Reversed: 2000 at 0, the empty param at the next 64-aligned start, 3000 after it.
    lay = build_layout([3000, 0, 2000], dp_size=4)
    assert lay.param_index_map == ((2048, 5048, 0), (2048, 2048, 0), (0, 2000, 0))
    assert lay.numel == 5120
    assert all(1 not in bucket for r in range(4) for bucket in lay.owned(r))
    assert sum(lay.owned_numel(r) for r in range(4)) == 5000


def test_rejects_bad_rank():
    lay = build_layout([4], dp_size=2)
    with pytest.raises(ValueError):
        lay.owned(2)


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 30))
    numels = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n))
    new_bucket = draw(
        st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n))
    )
    dp_size = draw(st.integers(1, 64))
    bucket_size = draw(st.one_of(st.none(), st.integers(1, 40_000)))
    pad = draw(st.booleans())
    kwargs = dict(
        numels=numels,
        dp_size=dp_size,
        bucket_size=bucket_size,
        pad_for_high_nccl_busbw=pad,
        new_bucket=new_bucket,
    )
    return kwargs, build_layout(**kwargs)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_layout_invariants(case):
    kwargs, lay = case
    numels, dp = kwargs["numels"], kwargs["dp_size"]
    flags = kwargs["new_bucket"] or [False] * len(numels)
    divisor = math.lcm(dp, 128, *([2**16] if kwargs["pad_for_high_nccl_busbw"] else []))

    # Params: 64-aligned, exact size, placed in reverse given order without overlap.
    assert len(lay.param_index_map) == len(numels)
    prev_end = 0
    for i in reversed(range(len(numels))):
        start, end, b = lay.param_index_map[i]
        assert start % 64 == 0
        assert end - start == numels[i]
        assert start >= prev_end
        bs, be = lay.bucket_indices[b]
        assert bs <= start and end <= be
        prev_end = end

    # Buckets: contiguous, cover the buffer, padded to the divisor.
    assert lay.bucket_indices[0][0] == 0
    assert lay.bucket_indices[-1][1] == lay.numel
    for (_s0, e0), (s1, _) in zip(lay.bucket_indices, lay.bucket_indices[1:]):
        assert e0 == s1
    for b, (s, e) in enumerate(lay.bucket_indices):
        params = lay.bucket_params[b]
        assert (e > s or all(numels[i] == 0 for i in params)) and (e - s) % divisor == 0
        assert params and list(params) == sorted(params, reverse=True)
        assert all(lay.param_index_map[i][2] == b for i in params)
        last_end = lay.param_index_map[params[-1]][1]
        assert lay.per_bucket_numel_unpadded[b] >= last_end - s
        assert e == -(-(s + lay.per_bucket_numel_unpadded[b]) // divisor) * divisor
    assert sorted(i for p in lay.bucket_params for i in p) == list(range(len(numels)))

    # Bucket closure: a bucket closes on the first param reaching bucket_size
    # (alignment gaps count), unless a shared embedding forces it earlier.
    for b, params in enumerate(lay.bucket_params):
        s = lay.bucket_indices[b][0]
        if any(flags[i] for i in params):
            assert len(params) == 1
            continue
        if kwargs["bucket_size"] is not None:
            for i in params[:-1]:
                assert lay.param_index_map[i][1] - s < kwargs["bucket_size"]
        is_final = b == lay.num_buckets - 1
        next_is_shared = not is_final and flags[lay.bucket_params[b + 1][0]]
        if not is_final and not next_is_shared:
            assert lay.per_bucket_numel_unpadded[b] >= kwargs["bucket_size"]

    # Ownership: the `param` sub-ranges of each param tile [0, numel) across ranks.
    pieces = {i: [] for i in range(len(numels))}
    total_owned = 0
    for r in range(dp):
        owned = lay.owned(r)
        assert len(owned) == lay.num_buckets
        for b, bucket in enumerate(owned):
            shard = lay.gbuf_world_range(b, r)
            bucket_start = lay.bucket_indices[b][0]
            assert shard.size == lay.shard_size(b)
            assert shard.start == bucket_start + r * lay.shard_size(b)
            for i, rng in bucket.items():
                assert i in lay.bucket_params[b]
                world, local = rng["gbuf_world"], rng["gbuf_local"]
                assert world.size == local.size == rng["param"].size > 0
                assert 0 <= local.start and local.end <= shard.size
                assert world == Range(local.start + shard.start, local.end + shard.start)
                assert rng["gbuf_world_in_bucket"] == Range(
                    world.start - bucket_start, world.end - bucket_start
                )
                assert world.start - lay.param_index_map[i][0] == rng["param"].start
                pieces[i].append(rng["param"])
        total_owned += lay.owned_numel(r)
    for i, ranges in pieces.items():
        ranges.sort(key=lambda x: x.start)
        if numels[i] == 0:  # an empty param: laid out, owned by nobody
            assert not ranges
            continue
        assert ranges[0].start == 0 and ranges[-1].end == numels[i]
        for a, c in zip(ranges, ranges[1:]):
            assert a.end == c.start
    assert total_owned == sum(numels)


def test_layout_is_hashable():
    # Lets a Layout be a static argument of jax.jit.
    a = build_layout([3, 4], dp_size=2, bucket_size=4)
    assert hash(a) == hash(build_layout([3, 4], dp_size=2, bucket_size=4))
