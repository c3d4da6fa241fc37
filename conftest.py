"""Doctest set-up (not shipped): doctests under jaxsync/ run with 8 fake CPU devices.

Like the tests (tests/conftest.py). It lives at the repository root, outside the
package, so that pytest applies it to ``jaxsync/`` without the wheel carrying it.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
