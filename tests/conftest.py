"""Every test runs on 8 simulated CPU devices (set once, before JAX starts).

The single-device references (`helpers.reference_run`) are computed once per session and shared
by the pytest-xdist workers through a directory the controlling process makes (its environment
is the workers') and removes when it exits.
"""

import atexit
import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
if "JZERO_TEST_REFERENCES" not in os.environ:
    os.environ["JZERO_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="jzero-test-references-")
    atexit.register(shutil.rmtree, os.environ["JZERO_TEST_REFERENCES"], ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
