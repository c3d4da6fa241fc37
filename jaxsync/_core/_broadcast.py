"""Parameter broadcast: every process starts from the root's values."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync._comm._agree import _disagreement
from jaxsync._comm._axis_backend import AxisComm
from jaxsync._comm._topology import Comms, default_comm

from ._plan import structure_text

PyTree = Any


def broadcast_params(tree: PyTree, root: int = 0, comm: Any = "auto") -> PyTree:
    """Return ``tree`` with every leaf replaced by the root process's value.

    Call it eagerly (outside ``jit``) on every process, e.g. on the initial
    parameters and optimizer state (Caffe2 ``_SyncAllParamsDistributed``,
    ChainerMN ``bcast_data``, Horovod ``broadcast_parameters``). Each leaf keeps
    its dtype, shape and, for ``jax.Array`` leaves, its sharding; every device of
    every process then holds the root's value. Before any data moves, the
    processes check that their trees agree; if not, every process raises the
    same ``ValueError``.

    Args:
      tree: a pytree of arrays (any dtype, including ints and bools).
      root: the rank whose values win.
      comm: an mpi4py communicator, ``jaxsync.AxisComm`` (then
        ``jax.distributed`` processes are used and ``root`` must be 0), ``None``
        (a single process: returns ``tree``) or ``"auto"``.

    Returns:
      a tree of the same structure, dtypes, shapes and shardings holding the
      root's values, the same on every process.

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> jaxsync.broadcast_params({"w": jnp.ones(2)}, comm=None)
      {'w': Array([1., 1.], dtype=float32)}
    """
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(
            f"broadcast_params got unexpected type for argument 'root' "
            f"(expected: int, got: {type(root).__name__})."
        )
    if isinstance(comm, str) and comm == "auto":
        comm = default_comm()
    if comm is None:
        if root != 0:
            raise ValueError(
                f"broadcast_params: root={root} but there is one process (comm=None). Fix: root=0."
            )
        return tree
    if isinstance(comm, AxisComm):
        if root != 0:
            raise ValueError(
                "broadcast_params with AxisComm broadcasts from process 0; "
                f"got root={root}. Fix: root=0."
            )
        from jax.experimental import multihost_utils

        out = multihost_utils.broadcast_one_to_all(tree)
        # broadcast_one_to_all returns host arrays: put each jax.Array leaf back
        # where it was (its sharding), not on the default device.
        return jax.tree.map(
            lambda new, old: (
                jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new
            ),
            out,
            tree,
        )
    size = comm.Get_size()
    if not 0 <= root < size:
        raise ValueError(f"broadcast_params: root must be in [0, {size}), got {root}.")
    world = Comms.of(comm).control
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    plan_text = _describe(tree)
    # A 32-byte digest per process; the texts travel only on a mismatch.
    digests = world.allgather(hashlib.sha256(plan_text.encode()).digest())
    if len(set(digests)) > 1:
        raise ValueError(_disagreement(world.allgather(plan_text), "parameter tree"))
    out = []
    for leaf in leaves:
        host = np.array(leaf, copy=True)
        buf = host.reshape(-1).view(np.uint8) if host.size else host
        if host.size:
            world.Bcast(buf, root=root)
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.Array) and sharding is not None:
            out.append(jax.device_put(host, sharding))
        elif isinstance(leaf, jax.Array):
            out.append(jnp.asarray(host))
        else:
            out.append(host)
    return jax.tree_util.tree_unflatten(treedef, out)


def _describe(tree) -> str:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # Shapes and dtypes from the leaf itself: no copy to host.
    lines = [
        f"leaf {jax.tree_util.keystr(path)} {np.shape(leaf)} {_dtype(leaf)}"
        for path, leaf in with_paths
    ]
    # Last: the first differing line names a leaf.
    lines.append(f"treedef {structure_text(treedef)}")
    return "\n".join(lines)


def _dtype(leaf):
    dt = getattr(leaf, "dtype", None)
    return np.dtype(dt) if dt is not None else np.result_type(leaf)
