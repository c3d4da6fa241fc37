"""Test setup: 8 fake CPU devices before JAX initialises (as equinox does)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
