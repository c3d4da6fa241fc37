"""Asynchronous native sums: ``asynchronous()`` makes the native MPI sums traced
inside it ``jaxsync_allreduce_async`` calls (``_mpi_ops._NativeOps`` reads
``ASYNC``); ``_overlap`` enters it for ``overlap=`` and ``double_buffering=``.

Imports: the standard library only.
"""

from __future__ import annotations

import contextlib
import contextvars

# Inside ``asynchronous()``: how the native sums run (None: blocking calls).
ASYNC: contextvars.ContextVar = contextvars.ContextVar("jaxsync_async", default=None)


@contextlib.contextmanager
def asynchronous(inplace: bool = True):
    """Native sums traced inside run on the communicator's thread (overlap).

    Each ``jaxsync_allreduce_async`` call returns at once; XLA runs the rest of
    the step until a result is needed. ``inplace=False`` writes fresh results
    instead of summing in place (for inputs XLA must keep, such as the state a
    double-buffered step reduces: no copy of it). Other backends ignore it (a
    mesh axis: XLA's own async collectives; mpi4jax and host staging block).
    """
    reset = ASYNC.set((bool(inplace),))
    try:
        yield
    finally:
        ASYNC.reset(reset)
