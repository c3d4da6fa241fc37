"""local_batch: this process's part of a global batch, placed on its devices.

Every process reads the same global batch (the same rows in the same order);
``local_batch`` keeps this process's rows, ``[p B/P, (p + 1) B/P)`` for process
``p`` of ``P`` (MPI's rank and size, or ``jax.distributed``'s process index and
count), and places them split along the batch axis over the mesh's devices
(``NamedSharding``), as the README's ``shard_map`` step takes them
(``in_specs=P("local")``). With a mesh that spans processes
(``jax.distributed``), each device gets its rows of the global array.

Imports: jax, numpy, ``_config`` (``AUTO``) and ``_comm._topology``
(``default_comm``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsync._comm import _topology

from ._config import AUTO, Comm

PyTree = Any


def _sharding(mesh_or_sharding) -> NamedSharding:
    if isinstance(mesh_or_sharding, Mesh):
        names = mesh_or_sharding.axis_names
        return NamedSharding(mesh_or_sharding, P(names if len(names) > 1 else names[0]))
    if isinstance(mesh_or_sharding, NamedSharding):
        return mesh_or_sharding
    raise TypeError(
        "local_batch: mesh_or_sharding must be a jax.sharding.Mesh or NamedSharding, got "
        f"{type(mesh_or_sharding).__name__}. Fix: pass the mesh of the shard_map step, "
        'e.g. Mesh(np.array(jax.local_devices()), ("local",)).'
    )


def _splits(sharding: NamedSharding) -> int:
    """How many device slices the batch axis is cut into."""
    spec = tuple(sharding.spec)
    first = spec[0] if spec else None
    if first is None:
        return 1
    axes = first if isinstance(first, tuple) else (first,)
    return int(np.prod([sharding.mesh.shape[a] for a in axes]))


def _process(comm) -> tuple[int, int]:
    """This process's index and the process count: MPI's, else jax.distributed's."""
    if isinstance(comm, str) and comm == AUTO:
        comm = _topology.default_comm()
    if comm is not None and hasattr(comm, "Get_rank"):  # MPI (an AxisComm: jax's)
        return int(comm.Get_rank()), int(comm.Get_size())
    return jax.process_index(), jax.process_count()


def local_batch(
    batch: PyTree, mesh_or_sharding: Mesh | NamedSharding, *, comm: Comm = AUTO
) -> PyTree:
    """This process's rows of a global batch, split over its devices.

    Every process passes the same global batch. Process ``p`` of ``P`` keeps
    rows ``[p B/P, (p + 1) B/P)`` of every leaf (``B`` its first axis) and puts
    them on the mesh's devices, split along that axis: the arrays to hand to
    a ``shard_map`` step whose batch enters with ``in_specs=P("local")``. The
    process index and count come from ``comm`` (MPI's rank and size) or, without
    one, from ``jax.distributed`` (one process: everything). With a mesh that
    spans processes (``jax.distributed``), the result is the global array, each
    device holding its rows.

    Args:
      batch: a pytree of arrays (numpy or jax) with the global batch as their
        first axis, the same on every process.
      mesh_or_sharding: a ``Mesh`` (the batch axis split over all its axes, in
        order) or a ``NamedSharding`` (its spec's first entry splits the batch
        axis).
      comm: ``"auto"`` (``MPI.COMM_WORLD`` under an MPI launcher with several
        processes, else none), an mpi4py communicator, or ``None`` or an
        ``AxisComm`` (``jax.process_index()`` / ``jax.process_count()``).

    Returns:
      the pytree of ``jax.Array`` s: this process's ``B/P`` rows placed with the
      sharding (a mesh spanning processes: the global ``B`` rows).

    Raises:
      ValueError: a leaf without a first axis, or one whose rows do not divide
        evenly among the processes and the devices.

    Example:
      >>> import jax, numpy as np, jaxsync
      >>> from jax.sharding import Mesh
      >>> mesh = Mesh(np.array(jax.local_devices()), ("local",))
      >>> batch = {"x": np.arange(32.0).reshape(16, 2), "y": np.arange(16)}
      >>> local = jaxsync.local_batch(batch, mesh)  # one process: every row
      >>> local["x"].shape, local["x"].sharding.spec
      ((16, 2), P('local',))
      >>> [int(s.data[0, 0]) for s in local["x"].addressable_shards][:3]
      [0, 4, 8]
    """
    sharding = _sharding(mesh_or_sharding)
    splits = _splits(sharding)
    spans = not sharding.is_fully_addressable  # a mesh over several processes
    index, count = (0, 1) if spans else _process(comm)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(batch)
    out = []
    for path, leaf in with_paths:
        name = jax.tree_util.keystr(path) or "the batch"
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"local_batch: {name} is a scalar; every leaf needs the batch as its first "
                "axis. Fix: pass per-example arrays (shape (B, ...)), or keep scalars out "
                "of the batch."
            )
        rows, parts = shape[0], count * (1 if spans else splits)
        if rows % parts or (spans and rows % splits):
            per = f"{count} processes x {splits} devices" if not spans else f"{splits} devices"
            raise ValueError(
                f"local_batch: {name} has {rows} rows, which do not split evenly over "
                f"{per} ({rows} % {max(parts, splits)} = {rows % max(parts, splits)}). "
                f"Fix: make the global batch a multiple of {max(parts, splits)} rows "
                "(drop or pad the last batch)."
            )
        if spans:
            out.append(jax.make_array_from_callback(shape, sharding, _rows_of(leaf)))
            continue
        b = rows // count
        mine = leaf[index * b : (index + 1) * b]
        out.append(jax.device_put(mine, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def _rows_of(leaf):
    """The callback that gives a device its index's part of ``leaf``."""

    def rows(index):
        return np.asarray(leaf[index])

    return rows
