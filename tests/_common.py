"""Shared set-up of the single-process test modules (8 fake devices, see conftest).

Reliability rows. Test comments cite "row N" of this table (it replaces a
design document that is not part of the repository):

====  ==========================================================  =========================
row   requirement                                                 tests
====  ==========================================================  =========================
1     processes with different tree structures: the same error    mpi/worker_agree.py
2     ... different leaf shapes: the same error, naming the leaf  mpi/worker_agree.py
3     ... different dtypes or options: the same error             mpi/worker_agree.py
4     tracing on one process never blocks (agreement in-step)     mpi/worker_harden.py
5     float0 leaves pass through a sync                           test_transforms.py
6     unbound or missing mapped axes raise at trace time          test_transforms.py,
                                                                  test_harden.py
7     bad arguments raise at factory time, naming the argument,   test_transforms.py,
      what was expected, what was given and a fix                 test_harden.py
8     a wrong optimizer state raises a TypeError                  test_transforms.py
9     a process that dies ends the job (no hang)                  mpi/worker_death.py
10    a straggler is reported by the watchdog; result unchanged   mpi/worker_watchdog.py
11    exit right after dispatching syncs is clean (device and     mpi/worker_death.py,
      host staging; communicators freed, watchdogs stopped)       mpi/worker_harden.py
12    many buckets and several syncs in one step: no deadlock,    test_strategies.py,
      no recompilation                                            mpi/worker_buckets.py
13    integer-valued gradients: exact closed form                 test_strategies.py,
                                                                  mpi/worker_exact.py
14    random data within a ULP bound of a float64 reference;      test_strategies.py,
      MPI and mesh backends bitwise equal                         mpi/test_mpi.py
15    determinism: replicas and reruns bit-identical              test_strategies.py
16    float16 overflow avoided by the predivide                   test_transforms.py,
                                                                  mpi/worker_harden.py
17    NaN/Inf on one replica; check_finite                        test_transforms.py,
                                                                  mpi/worker_harden.py
18    eager == jit                                                test_transforms.py
====  ==========================================================  =========================
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

N = 8
STRATEGIES = ["naive", "flat", "hierarchical", "two_dimensional", "single_node"]
INTER = [s for s in STRATEGIES if s != "single_node"]  # have an inter-process stage
MESH1 = Mesh(np.array(jax.devices()[:N]), ("i",))
MESH2 = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("host", "local"))
HL = ("host", "local")

# python -m jaxsync selftest's cases beyond one per strategy (test_cli.py, mpi/test_selftest_mpi.py)
SELFTEST_EXTRA_CASES = (
    "auto",
    "hierarchical overlap",
    "hierarchical double_buffering",
    "flat overlap double_buffering",
    "powersgd rank 2",
    "sign",
)

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def raises_then_clean(
    bad, good, errors=(FloatingPointError, jax.errors.JaxRuntimeError), match=None
):
    """The error that ``bad()`` raises (a host callback's, on several devices), then
    ``good()`` run and JAX's effects awaited.

    A multi-device callback error stays in JAX's runtime effect tokens until the next
    effectful computation on those devices: ``good()`` is that computation, so that
    later tests start clean. Fails the test unless ``bad()`` raises one of ``errors``
    (matching ``match``).
    """
    try:
        with pytest.raises(errors, match=match) as info:
            jax.block_until_ready(bad())
    finally:
        jax.block_until_ready(good())
        jax.effects_barrier()
    return info.value


def bits(x) -> np.ndarray:
    """The raw bits of an array, for bitwise comparisons."""
    a = np.asarray(x)
    return a.view(_UINT[a.dtype.itemsize])


class FakeComm:
    """An mpi4py-like communicator of ``size`` processes that all agree.

    This process is rank 0; ``allgather`` returns ``size`` copies of its object (and
    records it in ``gathered``); ``Bcast`` leaves the buffer as it is.
    """

    def __init__(self, size=2):
        self.size = size
        self.gathered = []

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def Dup(self):
        return self

    def Free(self):
        pass

    def allgather(self, obj):
        self.gathered.append(obj)
        return [obj] * self.size

    def Bcast(self, buf, root=0):
        pass
