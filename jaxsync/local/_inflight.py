"""Streaming's outer mean in flight across separate jitted steps (``overlap=True``).

At a fragment's send step a host callback copies its pseudo-gradient (already
divided by the island count when that is a power of two) into a buffer this
module owns (never an XLA buffer: nothing can be donated or reused under it)
and queues one ``MPI_Allreduce`` on the outer communicator's own thread (a
lane: jobs in the order they were queued, which is the step order on every
process), and returns a handle that the optimizer state carries. ``delay``
steps later a second callback waits for that job and returns the mean. The
transfer runs while the steps between compute: the lane's thread holds no
lock while MPI moves the bytes (mpi4py releases the GIL; MPI is initialised
with ``MPI_THREAD_MULTIPLE``, which jaxsync requires).

May import: JAX, numpy, mpi4py (lazily), ``jaxsync._comm._quiet`` (the exit
drain waits for the lane's jobs).
"""

from __future__ import annotations

import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxsync._comm import _quiet


class Lane:
    """One thread per communicator running its allreduces in order."""

    def __init__(self, comm):
        self.comm = comm.Dup()  # jaxsync's own: never the user's handle
        self.size = self.comm.Get_size()
        self.jobs: queue.Queue = queue.Queue()
        self.slots: dict = {}
        self.count = 0
        self.lock = threading.Lock()
        self.done = 0  # jobs finished (the exit drain waits for count == done)
        self.failed: BaseException | None = None  # set by fail_all (elastic recovery)
        _quiet.watch(lambda: (self.count, self.done))
        threading.Thread(target=self._loop, daemon=True, name="jaxsync-inflight").start()

    def _loop(self):
        from mpi4py import MPI

        while True:
            # The job carries its slot: ``finish`` may pop the slot from
            # ``slots`` before this thread takes the job (a lookup here raised
            # KeyError under load, killed the thread, and the step hung).
            slot = self.jobs.get()
            try:
                if self.failed is not None:  # the world was lost: no MPI on it
                    raise self.failed
                out = np.empty_like(slot[0])
                self.comm.Allreduce(slot[0], out, op=MPI.SUM)
                slot[2] = out
            except BaseException as e:  # noqa: BLE001 - raised where it is awaited
                slot[2] = e
            finally:
                slot[1].set()
                self.done += 1

    def start(self, buf) -> np.ndarray:
        slot = [np.array(buf, np.float32, copy=True), threading.Event(), None]
        with self.lock:
            handle = self.count
            self.count += 1
            self.slots[handle] = slot
            # Queued under the lock: the lane's order is the handles' order.
            self.jobs.put(slot)
        return np.asarray(handle, np.int32)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every job in flight or queued, and every later one, with ``exc``.

        Called by :func:`jaxsync.elastic.recover` after it revoked ``self.comm``
        (which ends an ``Allreduce`` the thread is blocked in): a pending slot
        raises ``exc`` where it is awaited instead of waiting; queued jobs are
        drained without MPI, so the exit drain's count catches up.
        """
        self.failed = exc
        with self.lock:
            slots = list(self.slots.values())
        for slot in slots:
            if not slot[1].is_set():
                slot[2] = exc
                slot[1].set()

    def finish(self, handle) -> np.ndarray:
        handle = int(handle)
        slot = self.slots.pop(handle, None)
        if slot is None:
            raise RuntimeError(
                f"jaxsync.diloco(overlap=True): no transfer in flight with handle {handle} "
                "in this process (a state restored from a checkpoint taken while a fragment "
                "was in flight?). Fix: checkpoint after a fragment's apply step, or use "
                "overlap=False (the held mean is saved with the state)."
            )
        slot[1].wait()
        if isinstance(slot[2], BaseException):
            raise slot[2]
        return slot[2]


_LANES: dict = {}


def lane(comm) -> Lane:
    """The lane of ``comm`` (made once, when the factory is called: collective)."""
    got = _LANES.get(id(comm))
    if got is None or got[0] is not comm:
        got = _LANES[id(comm)] = (comm, Lane(comm))
    return got[1]


def start(ln: Lane, leaves) -> jax.Array:
    """Queue the mean of ``leaves`` (float32) across the lane; its handle (int32)."""
    n = ln.size
    pre = float(n) if n & (n - 1) == 0 else 1.0
    flat = jnp.concatenate([x.reshape(-1) for x in leaves]) * jnp.float32(1.0 / pre)
    return io_callback(ln.start, jax.ShapeDtypeStruct((), jnp.int32), flat, ordered=False)


def finish(ln: Lane, handle, like) -> list:
    """Wait for ``handle``'s sum; the mean, as leaves shaped like ``like``."""
    n = ln.size
    post = 1.0 if n & (n - 1) == 0 else float(n)
    size = sum(int(np.prod(x.shape)) for x in like)
    flat = io_callback(ln.finish, jax.ShapeDtypeStruct((size,), jnp.float32), handle)
    if post != 1.0:
        flat = flat / jnp.float32(post)
    out, at = [], 0
    for x in like:
        k = int(np.prod(x.shape))
        out.append(flat[at : at + k].reshape(x.shape))
        at += k
    return out
