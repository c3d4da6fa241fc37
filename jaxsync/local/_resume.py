"""Checkpoints with a fragment's mean in flight (``overlap=True``):
:func:`in_flight` takes the sums a state's handles name (waited for, not taken),
:func:`resume_in_flight` puts them back in flight in a restored state (a handle
is a number of the process that started the sum: meaningless in another).

May import: numpy, JAX, ``_inflight`` (the native library), ``_state``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _inflight
from ._state import LocalUpdatesState


def _states(state) -> list:
    is_local = lambda x: isinstance(x, LocalUpdatesState)  # noqa: E731
    return [s for s in jax.tree.leaves(state, is_leaf=is_local) if is_local(s)]


def _handle(h) -> int | None:
    """``h`` as a handle (an int32 scalar of ``overlap=True``'s ``held``), or None."""
    if isinstance(h, (tuple, list)):  # the held form: (means, finite)
        return None
    if np.ndim(h) == 0 and np.asarray(h).dtype == np.int32:
        return int(np.asarray(h))
    return None


def has_sums(state: Any) -> bool:
    """Whether ``state`` holds a sum in flight (``jaxsync.elastic``'s commit saves it)."""
    handles = [_handle(h) for s in _states(state) for h in s.held]
    return any(h is not None and h >= 0 for h in handles)


def in_flight(state: Any) -> list[np.ndarray]:
    """The sums in flight in ``state`` (waited for), to save with a checkpoint.

    ``state`` is (or holds) the state of a local-update transform made with
    ``overlap=True`` (the held form's means are in the state itself: its entries
    come back empty, and :func:`resume_in_flight` leaves it as it is). Returns
    one uint8 array per fragment, in order (opaque:
    the float32 divisor that makes the sum a mean, then the sum's bytes as it
    travelled, in ``comm_dtype``; empty where none is in flight): save it beside
    the state, and after restoring give it to :func:`resume_in_flight`. The
    transfers are not taken: the running job goes on as if nothing happened.

    Example:
      >>> import numpy as np, jaxsync
      >>> state = jaxsync.LocalUpdatesState(0, {}, (), (), 0, held=(np.int32(-1),))
      >>> [x.shape for x in jaxsync.local.in_flight(state)]  # nothing in flight
      [(0,)]
    """
    lib, out = None, []
    for s in _states(state):
        for h in s.held:
            h = _handle(h)  # None: the held form (overlap=False), its mean in the state
            if h is None or h < 0:
                out.append(np.zeros(0, np.uint8))
                continue
            lib = lib or _inflight._lib()
            n = lib.jaxsync_inflight_size(h)
            got, err = np.empty(max(n, 0), np.uint8), ctypes.create_string_buffer(1024)
            post = ctypes.c_float(1.0)
            rc = -1 if n < 0 else lib.jaxsync_inflight_wait(h, got.ctypes.data, n, err, 1024, post)
            if rc == -1:
                raise ValueError(
                    f"jaxsync.local.in_flight: handle {h} is not in flight in this process "
                    "(a state restored from a checkpoint without its in-flight sums?). "
                    "Fix: call it on the state the running step returned."
                )
            if rc == -2:
                raise RuntimeError(f"jaxsync.local.in_flight: the sum failed: {err.value.decode()}")
            out.append(np.concatenate([np.array([post.value], np.float32).view(np.uint8), got]))
    return out


def resume_in_flight(state: Any, saved: list) -> Any:
    """``state`` (restored from a checkpoint) with the sums of :func:`in_flight`
    back in flight: each becomes a finished transfer of this process, taken at
    its fragment's apply step as if it had never stopped.

    Example:
      >>> import numpy as np, jaxsync
      >>> state = jaxsync.LocalUpdatesState(0, {}, (), (), 0, held=(np.int32(-1),))
      >>> jaxsync.local.resume_in_flight(state, [np.zeros(0, np.uint8)]).held
      (Array(-1, dtype=int32),)
    """
    it = iter(list(saved))
    count = sum(len(s.held) for s in _states(state))
    if count != len(saved):
        raise ValueError(
            f"jaxsync.local.resume_in_flight: saved has {len(saved)} entries, the state "
            f"{count} fragments in flight or not. Fix: pass what in_flight(state) returned "
            "for the state that was saved."
        )

    def put(x):
        x = np.ascontiguousarray(np.asarray(x).reshape(-1)).view(np.uint8)
        if not x.size:
            return jnp.array(-1, jnp.int32)
        post, data = float(x[:4].view(np.float32)[0]), np.ascontiguousarray(x[4:])
        h = _inflight._lib().jaxsync_inflight_put(data.ctypes.data, data.size, post)
        return jnp.array(h, jnp.int32)

    def one(s):
        if not isinstance(s, LocalUpdatesState):
            return s
        got = [(h, next(it)) for h in s.held]
        if any(_handle(h) is None for h, _ in got):  # the held form: nothing to resume
            return s
        return s._replace(held=tuple(put(x) for _, x in got))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, LocalUpdatesState))
