"""The ``jax.distributed`` peer: what a JAX user writes across processes without jaxsync.

What it is for: under mpirun, ``init`` joins every rank into one JAX multi-process
runtime (``jax.distributed.initialize``, gloo collectives on CPU) before JAX
starts its backends; ``GlobalMesh`` then builds the peer's step as a user writes
it: a mesh of every device of every process, the gradients as one global array
(``make_array_from_process_local_data``) and one ``lax.pmean`` of the whole tree
under ``jit(shard_map)``. jaxsync's own rows keep running on the local devices of
each process and MPI, in the same rounds.
What it may import: numpy, jax, mpi4py (the bench's communicator), the standard
library, ``jaxsync.bench.methods``; never jaxsync.

Example:
  >>> from jaxsync.bench import jaxdist
  >>> jaxdist.coordinator_host(["a", "a"], {})
  '127.0.0.1'
  >>> from jaxsync.cluster._spec import Spec
  >>> cluster = Spec(hosts=2, procs_per_host=1, link="1gbit").to_json()
  >>> jaxdist.coordinator_host(["host0", "host1"], {"JAXSYNC_CLUSTER": cluster})
  '10.233.0.10'
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

from .methods import fake_grads

AXIS = "all"


def coordinator_host(hostnames: list[str], env: Mapping[str, str]) -> str:
    """Where rank 0's coordinator is reachable by every rank.

    One machine: the loopback. The emulated cluster: host 0's address on its
    bridge. Elsewhere: rank 0's hostname, resolved.
    """
    if len(set(hostnames)) == 1:
        return "127.0.0.1"
    if env.get("JAXSYNC_CLUSTER"):
        from jaxsync.cluster._spec import Spec

        return Spec.from_json(env["JAXSYNC_CLUSTER"]).address(0)
    return socket.gethostbyname(hostnames[0])


def init(comm) -> None:
    """``jax.distributed.initialize`` over ``comm``'s ranks (call before JAX starts)."""
    import os

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = coordinator_host(comm.allgather(socket.gethostname()), os.environ)
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    jax.distributed.initialize(
        f"{host}:{port}", num_processes=comm.Get_size(), process_id=comm.Get_rank()
    )


class GlobalMesh:
    """The peer's steps over a mesh of every device of every process."""

    def __init__(self):
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.mesh = Mesh(np.array(jax.devices()), (AXIS,))
        self.sharding = NamedSharding(self.mesh, P(AXIS))

    def array(self, local_stacked: Any) -> Any:
        """The processes' stacked per-device trees as one global array per leaf."""
        import jax

        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.sharding, np.asarray(x)),
            local_stacked,
        )

    def step(self, sync: bool):
        """Per device: fake gradients, then (``sync``) one ``pmean`` of the whole tree."""
        import jax
        from jax import lax
        from jax.sharding import PartitionSpec as P

        def body(stacked):
            g = fake_grads(jax.tree.map(lambda x: x[0], stacked))
            if sync:
                g = lax.pmean(g, AXIS)
            return jax.tree.map(lambda x: x[None], g)

        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def local(tree: Any) -> Any:
    """This process's rows of a global result, stacked (for the results check only)."""
    import jax

    def one(a):
        if getattr(a, "is_fully_addressable", True):
            return np.asarray(a)
        shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])

    return jax.tree.map(one, tree)
