"""Waiting for jaxsync's MPI activity to end (before MPI and Python shut down).

``_drain`` runs at exit, before mpi4py's ``MPI_Finalize``; ``wait_until_quiet``
also runs before communicators are freed (``free_communicators``).

Imports: jax and ``_agree`` (its callback counters) only; ``_mpi_load`` tells it
about the native library (its call counters) when it loads it.
"""

from __future__ import annotations

import jax

from . import _agree

_LIB: list = []  # the native library once loaded (its call counters)


def count_native_calls(lib) -> None:
    """Watch ``lib``'s call counters too (called when the native library loads)."""
    _LIB[:] = [lib]


def _drain():
    wait_until_quiet()
    try:
        for a in jax.live_arrays():
            a.block_until_ready()
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


def wait_until_quiet(quiet_s: float = 0.25, limit_s: float = 10.0) -> bool:
    """Wait until no synchronised step is running (before MPI and Python shut down).

    A step dispatched and dropped (its results gone, so no live array to block
    on) still runs its MPI calls and its agreement callback. A default step has
    no effect that ``jax.effects_barrier`` could wait for (an effect would slow
    every dispatch), so this watches jaxsync's own activity instead: no native
    MPI call running, and none, nor any agreement callback, begun or ended for
    ``quiet_s`` seconds (chained steps start as their inputs become ready).
    Gives up after ``limit_s`` (a peer that never arrives). True when quiet.
    """
    import time

    lib = _LIB[0] if _LIB else None

    def state():
        calls = (
            (lib.jaxsync_calls_started(), lib.jaxsync_calls_finished())
            if lib is not None
            else (0, 0)
        )
        return (*calls, *_agree.ACTIVITY)

    def busy(cur) -> bool:
        return any(cur[i] != cur[i + 1] for i in range(0, len(cur), 2))

    start = now = time.monotonic()
    last, since = state(), start
    if last == _QUIET[0]:  # nothing ran since the last quiet wait (several exit hooks)
        return True
    while now - start < limit_s:
        time.sleep(0.01)
        now = time.monotonic()
        cur = state()
        if cur != last or busy(cur):
            last, since = cur, now
        elif now - since >= quiet_s:
            _QUIET[0] = cur
            return True
    return False


_QUIET: list = [None]  # jaxsync's activity counters at the last quiet wait
