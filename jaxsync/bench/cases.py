"""The cases of one tree: jaxsync's rows, the peers and the bare collective, in one step.

What it is for: ``IntraBench`` (one process, ``n`` fake devices, ``jit(shard_map)``
over the axis ``"d"``) and ``MPIBench`` (under mpirun: the README's step over the
local devices with ``axis_name="local"`` and ``comm=MPI.COMM_WORLD``, a whole train
step, the plain-``jit`` path and the mpi4jax / mpi4py peers, the bare mpi4py
``Allreduce``, and with ``jax.distributed`` joined the peer of ``jaxsync.bench.jaxdist``).
Each builds the ``Case`` list of a tree for ``timing.run_tree``.
What it may import: numpy, jax, optax, mpi4py, mpi4jax, ``jaxsync`` (public API)
and the other ``jaxsync.bench`` modules except ``report`` and ``cli``.

Example:
  >>> from jaxsync.bench import cases, trees
  >>> bench = cases.IntraBench(sweeps=False)
  >>> built, skipped = bench.cases(trees.small_leaves(3, 4), sweep=False)
  >>> [c.method for c in built][:3], bench.n
  (['base tree', 'base buffer', 'naive'], 8)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .hlo import _wire
from .methods import AXIS, DEFAULT_METHOD, LOCAL, fake_grads, jaxsync_methods, sweep_methods
from .peers import INTRA_PEERS, mpi4jax_per_leaf, mpi4py_host_per_leaf, ravel_mpi4jax
from .timing import Case, compile_cases
from .trees import tree_info


class _MeshBench:
    """Steps under ``jit(shard_map)`` over a 1-D mesh ``self.mesh`` of axis ``self.axis``."""

    axis: str
    mesh: Any
    n: int

    def _stacked(self, tree):
        """Per device, ones of the tree's shapes, stacked on a leading axis."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        sharding = NamedSharding(self.mesh, P(self.axis))
        make = jax.jit(
            lambda: jax.tree.map(lambda s: jnp.ones((self.n, *s.shape), s.dtype), tree),
            out_shardings=sharding,
        )
        return jax.block_until_ready(make())

    def _mapped(self, body):
        import jax
        from jax.sharding import PartitionSpec as P

        return jax.jit(
            jax.shard_map(body, mesh=self.mesh, in_specs=P(self.axis), out_specs=P(self.axis))
        )

    def _step(self, sync):
        """The README's step: per device, fake gradients, then the sync."""
        import jax

        def body(stacked):
            g = fake_grads(jax.tree.map(lambda x: x[0], stacked))
            if sync is not None:
                g = sync(g)
            return jax.tree.map(lambda x: x[None], g)

        return self._mapped(body)


class IntraBench(_MeshBench):
    """One process, ``n`` devices, ``jit(shard_map)`` over the mesh axis ``"d"``."""

    mode = "intra"
    axis = AXIS

    def __init__(self, sweeps: bool):
        import jax
        from jax.sharding import Mesh

        self.mesh = Mesh(np.array(jax.devices()), (AXIS,))
        self.n = jax.device_count()
        self.methods = jaxsync_methods(AXIS, None, mpi=False)
        self.sweeps = sweeps
        self.rank, self.barrier, self.comm = 0, None, None

    def cases(self, tree, sweep: bool) -> tuple[list[Case], dict]:
        import jax
        import jax.numpy as jnp
        from jax import lax

        arg = self._stacked(tree)
        buf = self._stacked(jax.ShapeDtypeStruct((tree_info(tree)[2] // 4,), jnp.float32))
        sweeps, skipped = sweep_methods(tree, AXIS, None) if sweep else ({}, {})

        def case(method, kind, sync, base="base tree", x=arg):
            return Case(method, kind, base, step=self._step(sync), arg=x)

        cases = [
            case("base tree", "base", None, None),
            case("base buffer", "base", None, None, buf),
            *(case(m, "jaxsync", s) for m, s in self.methods.items()),
            *(case(m, "peer", s) for m, s in INTRA_PEERS.items()),
            case("psum bare", "bare", lambda b: lax.psum(b, AXIS), "base buffer", buf),
            *(case(m, "sweep", s) for m, s in sweeps.items()),
        ]
        compile_cases(cases, self.n, 1)
        return cases, skipped


class MPIBench(_MeshBench):
    """Several processes under mpirun, ``devices`` devices each.

    The jaxsync rows run the way the README tells users to write their step:
    ``jit(shard_map)`` over a mesh of the local devices with ``axis_name="local"``
    (also when that axis has one device). With one device per process the plain
    ``jit`` path (``axis_name=None``, rows marked ``(jit)``) and the mpi4jax peers
    run beside it; mpi4jax's ordered effects refuse computations over several
    devices, so with more devices its rows are left out.
    """

    mode = "mpi"
    axis = LOCAL

    def __init__(self, comm, sweeps: bool, devices: int = 1):
        import jax
        from jax.sharding import Mesh

        self.comm = comm
        self.peer_comm = comm.Dup()
        self.rank, self.procs = comm.Get_rank(), comm.Get_size()
        self.barrier = comm.Barrier
        self.n = devices
        self.mesh = Mesh(np.array(jax.local_devices()[:devices]), (LOCAL,))
        import jaxsync

        topo = jaxsync.topology(comm)
        tiered = topo.hosts > 1 and topo.local_size > 1
        self.methods = jaxsync_methods(LOCAL, comm, mpi=True, tiered=tiered)
        self.jit_methods = (
            {f"{m} (jit)": s for m, s in jaxsync_methods(None, comm, mpi=True, host=True).items()}
            if devices == 1
            else {}
        )
        self.sweeps = sweeps
        c = self.peer_comm
        self.jit_peers = (
            {
                "mpi4jax/leaf": lambda g: mpi4jax_per_leaf(g, c),
                "ravel+mpi4jax": lambda g: ravel_mpi4jax(g, c),
            }
            if devices == 1
            else {}
        )

    def _train_step(self, tree, sync_factory):
        """A whole step: gradients of a loss, the sync, Adam, the new parameters."""
        import jax
        import jax.numpy as jnp
        import optax

        tx = (
            optax.adam(1e-3)
            if sync_factory is None
            else optax.chain(sync_factory(), optax.adam(1e-3))
        )
        state0 = jax.eval_shape(tx.init, tree)

        def body(stacked):
            params = jax.tree.map(lambda x: x[0], stacked)
            state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state0)

            def loss(p):
                return sum(
                    jnp.vdot(x, x * jnp.asarray(0.5, x.dtype)).astype(jnp.float32)
                    for x in jax.tree.leaves(p)
                )

            grads = jax.grad(loss)(params)
            updates, _ = tx.update(grads, state, params)
            return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates))

        return self._mapped(body)

    def cases(self, tree, sweep: bool) -> tuple[list[Case], dict]:
        import jax
        import jax.numpy as jnp
        from jax import lax
        from mpi4py import MPI

        import jaxsync

        arg = self._stacked(tree)
        nbytes = tree_info(tree)[2]
        buf = self._stacked(jax.ShapeDtypeStruct((nbytes // 4,), jnp.float32))
        sweeps, skipped = sweep_methods(tree, LOCAL, self.comm) if sweep else ({}, {})

        def case(method, kind, sync, base="base tree", x=arg):
            return Case(method, kind, base, step=self._step(sync), arg=x)

        def jit_case(method, kind, sync, base="base tree (jit)", x=None):
            x = jax.tree.map(lambda a: a[0], arg) if x is None else x
            step = jax.jit(lambda t: fake_grads(t) if sync is None else sync(fake_grads(t)))
            return Case(method, kind, base, step=step, arg=x)

        def mpi4jax_sum(b):
            import mpi4jax

            return mpi4jax.allreduce(b, op=MPI.SUM, comm=self.peer_comm)

        train = functools.partial(jaxsync.hierarchical_mean, axis_name=LOCAL, comm=self.comm)
        cases = [
            case("base tree", "base", None, None),
            case("base buffer", "base", None, None, buf),
            Case("train step (no sync)", "base", None, step=self._train_step(tree, None), arg=arg),
            *(case(m, "jaxsync", s) for m, s in self.methods.items()),
            Case(
                f"{DEFAULT_METHOD} in a train step",
                "jaxsync",
                "train step (no sync)",
                step=self._train_step(tree, train),
                arg=arg,
            ),
        ]
        if self.n > 1:  # the intra stage alone, for "bare allreduce + bare psum"
            cases.append(
                case("psum bare", "limit", lambda b: lax.psum(b, LOCAL), "base buffer", buf)
            )
        if self.n == 1:
            cases += [
                jit_case("base tree (jit)", "base", None, None),
                jit_case("base buffer (jit)", "base", None, None, buf[0]),
                *(jit_case(m, "jaxsync", s) for m, s in self.jit_methods.items()),
                *(jit_case(m, "peer", s) for m, s in self.jit_peers.items()),
                # the bare collective inside a jitted step, to tell MPI's cost
                # from the cost of calling it from XLA
                jit_case("mpi4jax bare", "limit", mpi4jax_sum, "base buffer (jit)", buf[0]),
            ]
        cases += [case(m, "sweep", s) for m, s in sweeps.items()]
        compile_cases(cases, self.n, self.procs)

        leaves = jax.tree.leaves(tree)
        extra = []
        if self.n == 1:
            base = next(c for c in cases if c.method == "base tree (jit)").run
            extra.append(
                Case(
                    "mpi4py/leaf host",
                    "peer",
                    "base tree (jit)",
                    run=lambda: mpi4py_host_per_leaf(base(), self.peer_comm),
                    arrays=len(leaves),
                    ops=len(leaves),
                    wire_bytes=sum(
                        _wire(
                            "allreduce", math.prod(x.shape) * max(x.dtype.itemsize, 4), self.procs
                        )
                        for x in leaves
                    ),
                )
            )
        send = np.ones(nbytes // 4, np.float32)
        recv = np.ones_like(send)
        wire = _wire("allreduce", send.nbytes, self.procs)
        extra += [
            Case(
                "mpi4py bare",
                "bare",
                None,
                run=lambda: self.peer_comm.Allreduce(send, recv, op=MPI.SUM),
                arrays=1,
                ops=1,
                wire_bytes=wire,
            ),
            Case(
                "mpi4py bare in-place",
                "limit",
                None,
                run=lambda: self.peer_comm.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM),
                arrays=1,
                ops=1,
                wire_bytes=wire,
            ),
        ]
        k = next(i for i, c in enumerate(cases) if c.kind == "sweep") if sweeps else len(cases)
        return cases[:k] + extra + self._jax_distributed(arg, wire) + cases[k:], skipped

    def _jax_distributed(self, arg, wire) -> list[Case]:
        """The ``jax.distributed`` peer (when ``jaxdist.init`` ran): a global mesh and
        one ``pmean``, beside its own base step on that mesh."""
        import jax

        if jax.process_count() == 1:
            return []
        from .jaxdist import GlobalMesh

        g = GlobalMesh()
        garg = g.array(arg)
        base = "base tree (global mesh)"
        cases = [
            Case(base, "base", None, step=g.step(False), arg=garg),
            Case("jax.distributed pmean", "peer", base, step=g.step(True), arg=garg),
        ]
        compile_cases(cases, self.n * self.procs, 1)
        cases[1].wire_bytes = wire  # an allreduce of the tree's bytes between processes
        return cases
