"""The spec path (`zero.path: spec`): sharding specs on every array; XLA emits and schedules the
collectives and partitions the optimizer's math, so any optax transformation works."""
