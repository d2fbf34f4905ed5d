"""The flat path (`zero.path: flat`): Megatron's flat buffers and their ownership, the bucketed
psum_scatter / all_gather in shard_map, the conversions to model space, the quantized gather."""
