"""Test setup: 8 fake CPU devices before JAX initialises (as equinox does)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_ignore_collect(collection_path, config):
    """Only test_*.py files are collected under tests/ (also for doctests).

    Worker scripts run as subprocesses (under mpirun or jax.distributed) and
    must never be imported by the pytest process. The conftest.py files load as
    conftests anyway; collecting them again for doctests imported each folder's
    under the one name ``conftest`` (an import mismatch between tests/conftest.py
    and tests/cluster/conftest.py).
    """
    del config
    if collection_path.suffix == ".py" and not collection_path.name.startswith("test_"):
        return True
    return None
