"""``python -m jaxsync tune``'s process tiers: shared memory and the network apart.

What it is for: under ``mpirun`` the processes may share one host (MPI over
shared memory: the ``"host"`` link) or span several (the ``"network"`` link
between hosts). :func:`measure_tiers` measures each tier this job has on its
own communicator, as the host tier (``JAXSYNC_HOST_TIER=1``) issues them:

* ``host``: jaxsync's native MPI calls among the processes of one host
  (``MPI.COMM_TYPE_SHARED``), every host at once; measured when a host holds
  more than one process (on one host: the whole job);
* ``network``: the same calls among one process per host (the hosts' leaders,
  local rank 0), while the other processes wait without spinning; measured
  when there are several hosts.

It returns the fitted links and a description per link of what was measured
(recorded in the profile's ``topology["measured"]``), together with the
emulated cluster's link rate where ``$JAXSYNC_CLUSTER`` names one. Rank 0's
fits are broadcast, so every process carries the same links.

May import: the standard library, JAX and mpi4py (inside functions),
``jaxsync._comm`` (``_topology``, ``_mpi_backend``: the native MPI ops) and
``jaxsync.auto._cost_fit``, ``_cost_ops``, ``_rounds``.
"""

from __future__ import annotations

import functools
import json
import os
import time

from . import _cost_fit, _cost_ops
from ._rounds import _time_rounds

MULTI = 8  # buffers in one call, to tell the cost per call from the cost per message


def _wait(req, poll: float = 0.005) -> None:
    """Wait for an MPI request without spinning (the waiting processes leave the
    cores to those that measure)."""
    while not req.Test():
        time.sleep(poll)


def cluster_link() -> dict | None:
    """The emulated cluster's link (``{"link": "1gbit", "rate_bps": 1e9, ...}``)
    from ``$JAXSYNC_CLUSTER`` inside ``python -m jaxsync cluster``, else None.

    Example:
      >>> import os
      >>> os.environ.pop("JAXSYNC_CLUSTER", None) and None
      >>> cluster_link() is None
      True
    """
    raw = os.environ.get("JAXSYNC_CLUSTER")
    if not raw:
        return None
    try:
        spec = json.loads(raw)
    except ValueError:
        return None
    out = {"link": spec.get("link"), "hosts": spec.get("hosts")}
    out["procs_per_host"] = spec.get("procs_per_host")
    try:
        from jaxsync.cluster._spec import parse_rate

        out["rate_bps"] = parse_rate(spec["link"])
    except (ValueError, KeyError, TypeError):
        out["rate_bps"] = None
    return out


def measure_process(comm, sizes, rounds: int, iters: int) -> list:
    """``(kind, nbytes, processes, seconds)``: jaxsync's native MPI calls in jit."""
    import jax
    import jax.numpy as jnp

    from jaxsync._comm import _mpi_backend
    from jaxsync._comm._topology import Comms

    comms = Comms.of(comm)
    P_ = comms.size
    handle = comms.world.py2f()
    dev = jax.local_devices()[0]
    out: list = []
    for n in sizes:
        m = max(P_ * MULTI, (n // 4) // (P_ * MULTI) * (P_ * MULTI))
        x = jax.device_put(jnp.ones((m,), jnp.float32), dev)

        def step(kind):
            def body(x):
                y = x * 1.0001 + 1.0  # noqa: B023
                ops = _mpi_backend._NativeOps(jnp.int32(handle), jnp.int32(1), P_)
                if kind == "allreduce":
                    return ops.allreduce([y])[0]
                if kind == "alltoall":
                    return ops.alltoall(y.reshape(P_, -1)).reshape(-1)
                if kind == "allgather":
                    return ops.allgather(y[: m // P_]).reshape(-1)  # noqa: B023
                if kind == "base part":
                    return y[: m // P_]  # noqa: B023
                if kind == "allreduce x":  # one native call, MULTI buffers
                    return jnp.concatenate(ops.allreduce(list(y.reshape(MULTI, -1))))
                return y

            return jax.jit(body)

        fns = {
            k: functools.partial(step(k), x)
            for k in ("base", "base part", "allreduce", "alltoall", "allgather", "allreduce x")
        }
        got = _time_rounds(fns, "base", rounds, iters, comms.control)
        out += [
            (k, m * 4, P_, t - (got["base part"] if k == "allgather" else 0.0))
            for k, t in got.items()
            if k not in ("base part", "allreduce x")
        ]
        # the native call sums buffers under 64 KiB together: count its messages
        msgs, _ = _cost_ops._native_messages([("f32", m * 4 // MULTI)] * MULTI)
        out.append(("allreduce", msgs[0], P_, got["allreduce x"], len(msgs)))
    return out


def measure_tiers(comm, topo, sizes, rounds: int, iters: int, log) -> tuple[list, dict, dict, dict]:
    """Measure and fit each process tier of ``comm``'s job.

    Collective over ``comm``. ``topo`` is ``jaxsync.topology(comm)``.

    Returns:
      ``(links, fit, raw, measured)``: ``[(name, Link)]``, the fit reports and
      raw samples per link, and ``{name: what was measured}``.
    """
    from mpi4py import MPI

    from jaxsync._comm._topology import Comms

    comms = Comms.of(comm)
    control = comms.control
    per_host = control.allreduce(topo.local_size, op=MPI.MAX)
    links, fit, raw, measured = [], {}, {}, {}

    def tier(name, sub, member, what):
        if member:
            s = measure_process(sub, sizes, rounds, iters)
            link, rep = _cost_fit.fit_link(s)
            got = (link, rep, s)
        else:
            got = None
        _wait(control.Ibarrier())
        got = control.bcast(got, root=0)  # rank 0 is a member of every tier
        if got is not None:
            links.append((name, got[0]))
            fit[name], raw[name], measured[name] = got[1], got[2], what

    if topo.hosts == 1:
        log(f"host link: {topo.size} processes on one host (shared memory)")
        tier("host", comm, True, f"{topo.size} processes of one host (shared memory)")
    else:
        if per_host > 1:
            log(f"host link: the processes of each host ({per_host} at most), every host at once")
            tier(
                "host",
                comms.host,
                True,
                f"the {topo.local_size} processes of each of {topo.hosts} hosts, "
                "every host at once (shared memory)",
            )
        # this local rank's process of every host (kept: Comms caches its duplicates)
        cross = control.Split(topo.local_rank, key=topo.rank)
        log(f"network link: {topo.hosts} processes, one per host (the hosts' leaders)")
        tier(
            "network",
            cross,
            topo.local_rank == 0,
            f"{topo.hosts} processes, one per host (local rank 0 of each)",
        )
    return links, fit, raw, measured
