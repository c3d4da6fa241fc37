"""The peers: what a user would write instead of jaxsync, timed beside it.

What it is for: the rows of kind ``peer`` (and the collectives of the ``bare`` /
``limit`` rows built in ``jaxsync.bench.cases``): inside one process, per-leaf
``lax.pmean``, one ``pmean`` of the whole tree and ``ravel_pytree`` + ``pmean``;
across processes (plain ``jit``, one device per process), per-leaf
``mpi4jax.allreduce``, ``ravel_pytree`` + one ``mpi4jax.allreduce`` and per-leaf
``np.asarray`` + mpi4py ``Allreduce``. mpi4jax and mpi4py have no bfloat16 type:
those peers send 16-bit leaves as float32.
What it may import: numpy, jax, mpi4jax, mpi4py and ``jaxsync.bench.methods``
(the axis name); never jaxsync (the peers do not use it).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxsync.bench import peers
  >>> f = jax.vmap(peers.ravel_pmean, axis_name=peers.AXIS)
  >>> f({"w": jnp.arange(4.0)})["w"]
  Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from .methods import AXIS

# Peers inside one process (traced inside shard_map over AXIS).


def pmean_per_leaf(g):
    """One ``lax.pmean`` per leaf."""
    import jax
    from jax import lax

    return jax.tree.map(lambda x: lax.pmean(x, AXIS), g)


def pmean_tree(g):
    """One ``lax.pmean`` of the whole tree (XLA emits one multi-operand all-reduce)."""
    from jax import lax

    return lax.pmean(g, AXIS)


def ravel_pmean(g):
    """``ravel_pytree`` (promotes to one dtype), one ``pmean``, unravel."""
    from jax import lax
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(g)
    return unravel(lax.pmean(flat, AXIS))


INTRA_PEERS = {"pmean/leaf": pmean_per_leaf, "pmean/tree": pmean_tree, "ravel+pmean": ravel_pmean}


# Peers across processes (plain jit, one device per process).


def _wide(x):
    """MPI has no 16-bit float type: send float16/bfloat16 as float32."""
    import jax.numpy as jnp

    return x.astype(jnp.float32) if x.dtype.itemsize == 2 else x


def mpi4jax_mean(x, comm):
    import mpi4jax
    from mpi4py import MPI

    y = mpi4jax.allreduce(_wide(x), op=MPI.SUM, comm=comm)
    return (y / comm.Get_size()).astype(x.dtype)


def mpi4jax_per_leaf(g, comm):
    """One ``mpi4jax.allreduce`` per leaf."""
    import jax

    return jax.tree.map(lambda x: mpi4jax_mean(x, comm), g)


def ravel_mpi4jax(g, comm):
    """``ravel_pytree`` + one ``mpi4jax.allreduce`` + unravel."""
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(g)
    return unravel(mpi4jax_mean(flat, comm))


def mpi4py_host_per_leaf(g, comm):
    """Host staging by hand: ``np.asarray`` + ``comm.Allreduce`` per leaf, back
    to the device (runs outside jit, on the result of the step)."""
    import jax
    from mpi4py import MPI

    size = comm.Get_size()

    def one(x):
        a = np.asarray(x)
        a = a.astype(np.float32) if a.dtype.itemsize == 2 else a
        out = np.empty_like(a)
        comm.Allreduce(a, out, op=MPI.SUM)
        out /= size
        return jax.device_put(out.astype(x.dtype))

    return jax.tree.map(one, g)
