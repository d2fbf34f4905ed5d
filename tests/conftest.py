"""Every test runs on 8 simulated CPU devices (set once, before JAX starts)."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
