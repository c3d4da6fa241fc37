"""Collectives of a benchmarked step: arrays and modelled wire bytes (jaxpr), ops (HLO).

What it is for: the ``arrays``, ``wire_bytes`` and ``ops`` columns of the bench.
jaxsync's collectives are recognised by their primitive names in the jaxpr
(``jaxsync_native``, ``jaxsync_mpi``, host callbacks) and by their custom-call
targets in the HLO: reading a traced program, not importing jaxsync's internals.
What it may import: jax (``jax.extend.core``) and the standard library only.

"Wire bytes" are modelled: what each replica sends under bandwidth-optimal
algorithms (allreduce ``2(p-1)/p·B``, reduce-scatter and all-to-all ``(p-1)/p·B``,
all-gather ``(p-1)·b``).

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> from jaxsync.bench import hlo
  >>> mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  >>> f = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g, "d"), mesh=mesh,
  ...                           in_specs=P("d"), out_specs=P()))
  >>> traced = f.trace(jnp.ones((4, 256)))
  >>> hlo.collective_stats(traced.jaxpr, axis_size=4, procs=1)  # 1 KiB each: 2*3/4 KiB
  (1, 1536.0)
  >>> hlo.hlo_collectives(traced.lower().compile().as_text())
  1
"""

from __future__ import annotations

import re

_AXIS_KIND = {
    "psum": "allreduce",
    "psum_invariant": "allreduce",
    "pmax": "allreduce",
    "pmin": "allreduce",
    "reduce_scatter": "reduce_scatter",
    "all_gather": "allgather",
    "all_gather_invariant": "allgather",
    "all_to_all": "alltoall",
}
_MPI_KIND = {
    "allreduce_mpi": "allreduce",
    "allgather_mpi": "allgather",
    "alltoall_mpi": "alltoall",
    "bcast_mpi": "bcast",
}
_HOST_KIND = {
    "host_allreduce": "allreduce",
    "host_alltoall": "alltoall",
    "host_allgather": "allgather",
}


def _wire(kind: str, nbytes: float, p: int) -> float:
    """Bytes one member sends for a collective whose local operand has nbytes."""
    if p <= 1:
        return 0.0
    return {
        "allreduce": 2 * (p - 1) / p * nbytes,
        "allreduce_async": 2 * (p - 1) / p * nbytes,  # overlap's, per bucket
        "reduce_scatter": (p - 1) / p * nbytes,
        "alltoall": (p - 1) / p * nbytes,
        "allgather": (p - 1) * nbytes,
        "bcast": nbytes,
        "reduce": nbytes,  # the host tier's: onto one member
    }[kind]


def _tier_wire(nbytes: int, host_size: int, procs: int, leader_only: bool) -> float:
    """Bytes one member sends in ``jaxsync_tier`` (the host tier's three steps in
    one call): as the three calls it stands for send them (``procs // host_size``
    hosts; ``leader_only``: reduce, the leaders' allreduce, broadcast, counted on
    a leader; else reduce-scatter, allreduce of the slice, all-gather)."""
    hosts = max(1, procs // max(1, host_size))
    if leader_only:
        host = _wire("reduce", nbytes, host_size) + _wire("bcast", nbytes, host_size)
        return host + _wire("allreduce", nbytes, hosts)
    part = nbytes / max(1, host_size)
    host = _wire("reduce_scatter", nbytes, host_size) + _wire("allgather", part, host_size)
    return host + _wire("allreduce", part, hosts)


def _eqn_collective(eqn, axis_size: int, procs: int):
    """(kind, group size) of a collective equation, or None."""
    name = eqn.primitive.name
    if name in _AXIS_KIND:
        return _AXIS_KIND[name], axis_size
    if name in _MPI_KIND:
        return _MPI_KIND[name], procs
    if name == "jaxsync_mpi":
        return eqn.params["kind"], eqn.params["comm"].comm.Get_size()
    if name == "jaxsync_native":  # operands: token, comm, active, buffers...
        if eqn.params["kind"] == "agree":  # the agreement check: no data moves
            return None
        return eqn.params["kind"], eqn.params["size"]
    if name == "pure_callback":
        fn = getattr(eqn.params["callback"], "callback_func", None)
        kind = _HOST_KIND.get(getattr(fn, "__name__", ""))
        return (kind, procs) if kind else None
    return None


def collective_stats(jaxpr, axis_size: int, procs: int) -> tuple[int, float]:
    """(arrays handed to collectives, wire bytes) of one execution, from the
    jaxpr; of cond branches, the costliest is counted (only one runs)."""
    from jax.extend.core import jaxprs_in_params

    arrays, wire = 0, 0.0
    for eqn in jaxpr.eqns:
        got = _eqn_collective(eqn, axis_size, procs)
        if got is not None:
            kind, p = got
            operands = eqn.invars[3:] if eqn.primitive.name == "jaxsync_native" else eqn.invars
            avals = [v.aval for v in operands if hasattr(v.aval, "dtype")]  # not tokens
            arrays += len(avals)
            nbytes = sum(a.size * a.dtype.itemsize for a in avals)
            if kind == "tier":  # the host tier in one call (chunk > 0: leader_only)
                wire += _tier_wire(nbytes, p, procs, eqn.params["chunk"] > 0)
            else:
                wire += _wire(kind, nbytes, p)
        subs = [collective_stats(j, axis_size, procs) for j in jaxprs_in_params(eqn.params)]
        if eqn.primitive.name == "cond" and subs:
            subs = [max(subs, key=lambda s: s[1])]
        for a, w in subs:
            arrays += a
            wire += w
    return arrays, wire


_HLO_COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\(|"
    r'custom_call_target="(mpi_\w+_ffi|jaxsync_\w+|xla_ffi_python_cpu_callback)"|'
    r"custom_call @(mpi_\w+_ffi|jaxsync_\w+|xla_ffi_python_cpu_callback)\("
)


def hlo_collectives(hlo_text: str) -> int:
    """Collective instructions in compiled HLO (XLA may combine several arrays
    into one multi-operand all-reduce; MPI and host callbacks count one each).
    Also counts MPI custom calls in StableHLO text."""
    return sum(1 for line in hlo_text.splitlines() if _HLO_COLLECTIVE.search(line))
