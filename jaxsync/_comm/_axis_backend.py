"""Inter-process stages that XLA runs: a mesh axis (``AxisComm``), or none at all.

A backend's ``run(program, bufs, intra, leader_only)`` runs ``program(ops,
bufs)`` with ``ops`` reducing *across processes*: here over a mesh axis
(:class:`AxisBackend`, for ``comm=jaxsync.AxisComm(...)``) or not at all
(:class:`LocalBackend`, one process). The MPI backend is in ``_mpi_backend``.

Imports: jax and ``_intra`` only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax import lax

from ._intra import AxisOps, check_axes


class LocalBackend:
    """No inter-process stage: one process."""

    name = "none"
    mesh_axes: tuple = ()

    def size(self) -> int:
        return 1

    def run(self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes=None, tiered=False):
        del intra, leader_only, group_bytes, tiered
        return program(AxisOps(()), bufs)

    def agree(self, text: str, what: str, bufs: list) -> list:
        del text, what
        return bufs

    def __repr__(self):
        return "LocalBackend()"


@dataclasses.dataclass(frozen=True)
class AxisComm:
    """Use a mesh axis, reduced by XLA, as the inter-process stage.

    Pass it as ``comm=jaxsync.AxisComm("host")`` and run the step under
    ``shard_map`` over a mesh with axes ``("host", "local")``: in one process
    that simulates hosts on fake devices; after ``jax.distributed.initialize``
    the same code spans real processes (gloo collectives on CPU, NCCL on GPU).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxsync
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("host", "local"))
      >>> tx = jaxsync.hierarchical_mean(axis_name="local",
      ...                                comm=jaxsync.AxisComm("host"))
      >>> def f(g):
      ...     out, _ = tx.update({"g": g}, tx.init({"g": g}))
      ...     return out["g"]
      >>> g = jnp.arange(8.0)  # replica i holds the value i
      >>> jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("host", "local")),
      ...                       out_specs=P(("host", "local"))))(g)
      Array([3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5], dtype=float32)
    """

    axis_name: Any

    def __post_init__(self):
        if not isinstance(self.axis_name, str):
            raise TypeError(
                f"AxisComm got unexpected type for argument 'axis_name' (expected: "
                f"str, got: {type(self.axis_name).__name__}). Fix: AxisComm('host')."
            )


class AxisBackend:
    """Inter-process stage over a mesh axis, reduced by XLA."""

    name = "axis"

    def __init__(self, axis: AxisComm):
        self.axis = axis.axis_name
        self.mesh_axes = (axis.axis_name,)

    def size(self) -> int:
        check_axes((self.axis,), "comm axis")
        return lax.axis_size(self.axis)

    def run(self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes=None, tiered=False):
        # XLA runs the collective on every device; a mesh axis has no host tier.
        del intra, leader_only, tiered
        return program(AxisOps((self.axis,), wire16=True), bufs)

    def agree(self, text: str, what: str, bufs: list) -> list:
        del text, what  # one program, traced once: nothing can disagree
        return bufs

    def __repr__(self):
        return f"AxisBackend({self.axis!r})"
