"""The flat path's quantized param all-gather (ZeRO++ qwZ, Megatron's `fp8_param_gather`).

After the optimizer step each rank holds its updated fp32 shard of a bucket, `x[S]` (S =
S_b / d). Instead of casting it to the param dtype and all-gathering that, it sends one byte
per element and a scale per block:

  blocks:   the shard cut into blocks of `BLOCK` elements, `x[k*BLOCK : (k+1)*BLOCK]`; the last
            block of a shard is shorter when BLOCK does not divide S (a shard is a multiple of
            128 / gcd(d, 128) elements, not of 128: no block size divides every shard). Blocks
            never straddle two ranks' shards, so each rank quantizes alone.
  scale:    symmetric absmax, `scale_k = max|x_block| x fp32(1 / QMAX)` (QMAX 127 for int8, 448
            for float8_e4m3fn, its largest finite value); an all-zero block (padding) gets scale 1,
            a block holding a NaN or an inf a NaN or inf scale: the model copy shows it, never hides it.
  codes:    int8 `clip(round(x / scale), -127, 127)`; float8_e4m3fn `x / scale` rounded to the
            nearest e4m3fn (clipped to +-448 first: e4m3fn has no infinity, an overflow is NaN).
  wire:     the codes `[S]` (1 byte each) and the fp32 scales `[ceil(S / BLOCK)]`, all-gathered
            over the bucket's DP domain by the same gather, so piece r of both is rank r's.
  model:    `codes * scale` in fp32, cast to the param dtype.

Per device a bucket's gather then moves (d-1)/d x d (S + 4 ceil(S / BLOCK)) bytes on a ring,
against (d-1)/d x d S x 2 in bf16. fp32 scales, not bf16: measured on Gaussian blocks of 2048
the relative RMS error of the model copy is the same to three digits (int8 8.26e-3, fp8
2.65e-2), and the worst element's a little larger with bf16 scales (absmax / scale then misses
QMAX), for 0.1% of the wire bytes.

fp8 codes travel as their bytes (`uint8`): XLA:CPU promotes an f8e4m3fn all-gather to f16 (seen,
jax 0.10.2; XLA:GPU keeps f8e4m3fn), and a bitcast is free. Only the model copy is quantized:
the fp32 main params, which the optimizer steps and checkpoints save, stay exact.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jzero.zero.config import ParamGatherDType

BLOCK = 2048  # elements per scale: ZeRO++'s weight-quantization group size
QMAX = {ParamGatherDType.INT8: 127.0, ParamGatherDType.FLOAT8_E4M3FN: 448.0}
_CODE = {ParamGatherDType.INT8: jnp.int8, ParamGatherDType.FLOAT8_E4M3FN: jnp.float8_e4m3fn}
_WIRE = {ParamGatherDType.INT8: jnp.int8, ParamGatherDType.FLOAT8_E4M3FN: jnp.uint8}


def n_blocks(size: int, block: int = BLOCK) -> int:
    """Blocks (scales) of a shard of `size` elements."""
    return -(-size // block)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """[..., S] -> [..., ceil(S / block), block], zero-padded at the end."""
    size = x.shape[-1]
    pad = n_blocks(size, block) * block - size
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block)


def quantize(x: jax.Array, dtype: ParamGatherDType, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """One rank's shard [S] (per device, inside shard_map) -> (codes [S] in the wire dtype: int8, or
    fp8's bytes as uint8; scales f32 [ceil(S / block)])."""
    size = x.shape[0]
    blocks = _blocks(x.astype(jnp.float32), block)  # [nb, block]
    amax = jnp.max(jnp.abs(blocks), axis=-1)  # [nb]
    qmax = QMAX[dtype]
    # x (1 / QMAX), spelled out: XLA turns a division by a constant into that product anyway.
    scale = amax * jnp.float32(1 / qmax)
    # A block of zeros, or one so small its scale flushes to 0 (absmax < ~5e-36 for fp8), gets
    # scale 1 (its codes round to 0): never 0 / 0. A nan or inf block keeps its non-finite scale.
    scale = jnp.where(scale == 0, 1.0, scale)
    y = jnp.clip((blocks / scale[:, None]).reshape(-1)[:size], -qmax, qmax)
    if dtype == ParamGatherDType.INT8:
        y = jnp.round(y)
    codes = y.astype(_CODE[dtype])
    return jax.lax.bitcast_convert_type(codes, _WIRE[dtype]), scale


def dequantize(
    codes: jax.Array, scales: jax.Array, size: int, dtype: ParamGatherDType, out_dtype, block: int = BLOCK
) -> jax.Array:
    """Gathered codes [d * size] and scales [d * ceil(size / block)] (piece r rank r's) -> the bucket
    [d * size] in `out_dtype`: each code times its block's scale, in fp32."""
    nb = n_blocks(size, block)
    d = scales.shape[0] // nb
    codes = jax.lax.bitcast_convert_type(codes, _CODE[dtype]).astype(jnp.float32).reshape(d, size)
    values = _blocks(codes, block) * scales.reshape(d, nb)[:, :, None]  # [d, nb, block]
    return values.reshape(d, -1)[:, :size].reshape(-1).astype(out_dtype)


def gather_quantized(
    x: jax.Array, gather: Callable[[jax.Array], jax.Array], dtype: ParamGatherDType, out_dtype, block: int = BLOCK
) -> jax.Array:
    """This rank's fp32 shard [S] -> the whole bucket [d * S] in `out_dtype`, replicated over the
    bucket's DP domain: its codes and scales gathered by `gather` (an all_gather over that domain,
    tiled on the last axis; per device, inside shard_map). A scanned stack's shard [L, S] -> [L, d * S]:
    each layer's row quantized in blocks of its own, as an unstacked shard's."""
    size = x.shape[-1]
    if x.ndim > 1:
        codes, scales = jax.vmap(lambda row: quantize(row, dtype, block))(x)
        back = lambda c, s: dequantize(c, s, size, dtype, out_dtype, block)  # noqa: E731
        return jax.vmap(back)(gather(codes), gather(scales))
    codes, scales = quantize(x, dtype, block)
    return dequantize(gather(codes), gather(scales), size, dtype, out_dtype, block)
