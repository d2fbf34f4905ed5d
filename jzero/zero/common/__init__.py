"""What both ZeRO paths share: the sharding plan, the train state, the optimizer update, param groups,
loss scaling, FSDP units, the batch split, host offload and the build-time checks of the optax chain."""
