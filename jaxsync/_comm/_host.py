"""Host-side tuning for CPU runs of the MPI backend."""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4

_tuned = False  # set once tune_host_allocator() took effect in this process
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_")


def tune_host_allocator(
    mmap_threshold: int = 32 * 2**20,
    trim_threshold: int = 2**30,
    top_pad: int = 256 * 2**20,
    map_large: bool = False,
) -> bool:
    """Let glibc reuse large host buffers instead of mapping fresh pages each step.

    XLA's CPU runtime allocates each step's large buffers with ``malloc``; above
    glibc's mmap threshold (128 KiB to start with) every allocation is a fresh
    ``mmap`` whose pages fault in on first touch, and an MPI allreduce into a
    fresh 22 MB buffer spends most of its time in page faults. Raising the mmap
    and trim thresholds and the top pad (like ``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` in the environment, but at
    run time) keeps such buffers in the heap for reuse. glibc caps the mmap
    threshold at 32 MiB, so by default mapping is turned off altogether (like
    ``MALLOC_MMAP_MAX_=0``): with 8 fake devices a ``flat_mean`` step's
    temporaries of 32 MiB per device were mapped afresh on every call (up to
    29,000 page faults per call, up to 62 ms against 25-27 ms). glibc still
    maps an allocation its heaps cannot hold. Process-wide; the cost is memory
    kept by the heap rather than returned to the system. Call it once, early,
    on every process. No effect (returns False) where the C library is not
    glibc.

    Args:
      mmap_threshold: bytes; with ``map_large``, allocations at least this
        large are mapped afresh (glibc's ``M_MMAP_THRESHOLD``; its ceiling is
        32 MiB on 64-bit).
      trim_threshold: bytes of free heap top kept before it is returned to the
        system (``M_TRIM_THRESHOLD``).
      top_pad: extra bytes requested from the system on each heap growth
        (``M_TOP_PAD``).
      map_large: keep glibc's mapping of allocations above ``mmap_threshold``
        (``M_MMAP_MAX`` left as it is) instead of turning it off.

    Returns:
      ``True`` when glibc took the settings, ``False`` where the C library is
      not glibc (nothing changed).

    Example:
      Once, early, on every process (returns ``True`` with glibc)::

        import jaxsync
        jaxsync.tune_host_allocator()

      The arguments are checked before anything changes:

      >>> import jaxsync
      >>> jaxsync.tune_host_allocator(mmap_threshold=0)
      Traceback (most recent call last):
      ...
      ValueError: tune_host_allocator: mmap_threshold must be a positive int (bytes), got 0.
    """
    for arg, value in (
        ("mmap_threshold", mmap_threshold),
        ("trim_threshold", trim_threshold),
        ("top_pad", top_pad),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"tune_host_allocator: {arg} must be a positive int (bytes), got {value!r}."
            )
    if not isinstance(map_large, bool):
        raise ValueError(
            f"tune_host_allocator: map_large must be True or False, got {map_large!r}."
        )
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1 and ok
    ok = mallopt(_M_TOP_PAD, int(top_pad)) == 1 and ok
    if not map_large:
        ok = mallopt(_M_MMAP_MAX, 0) == 1 and ok
    global _tuned
    _tuned = _tuned or bool(ok)
    return bool(ok)


def host_allocator_state() -> str:
    """``"tuned"`` when :func:`tune_host_allocator` took effect in this process or
    glibc's settings were made in the environment (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_MAX_``), else ``"default"``.

    A cost-model profile records it (``python -m jaxsync tune
    --tune-host-allocator``): large fresh buffers cost page faults with glibc's
    defaults and not once the allocator keeps them, so a profile describes one
    of the two, and ``strategy="auto"`` notes a profile measured with the other.

    Returns:
      ``"tuned"`` or ``"default"``.

    Example:
      >>> import jaxsync
      >>> jaxsync.host_allocator_state() in ("tuned", "default")
      True
    """
    import os

    return "tuned" if _tuned or any(os.environ.get(k) for k in _ENV) else "default"
