"""Collectives over XLA mesh axes: the intra-process stage (and a mesh-axis inter stage).

Everything here runs inside a mapped context (``shard_map``, ``pmap`` or
``vmap(axis_name=...)``), or under plain ``jit`` when a process has a single
device and no intra axes. :class:`AxisOps` sums, all-to-alls and all-gathers
over XLA axes; ``bound_axes``, ``check_axes`` and ``axes_size`` ask which axes
are bound where a synchronisation is traced.

Imports: jax only (no jaxsync module); every other collective module builds on it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src import core as _core
from jax._src import mesh as _mesh
from jax._src.interpreters import batching as _batching
from jax._src.lax import parallel as _parallel

Axes = tuple

# The all-gather typed as replicated over its axes (shard_map's check_vma): jax 0.7 to
# 0.10 name it all_gather_invariant, jax 0.11-0.12 _all_gather_invariant (the plain
# lax.all_gather's result is typed varying, which an out_specs of P() refuses).
_all_gather_invariant = getattr(_parallel, "all_gather_invariant", None) or getattr(
    _parallel, "_all_gather_invariant", None
)


def _is_batched(x) -> bool:
    return isinstance(x, _batching.BatchTracer)


def _invariant_gather(x, axes: Axes) -> bool:
    """Whether an all-gather over ``axes`` is typed replicated (``shard_map``'s
    ``check_vma``): the axes are manual ones (``shard_map``, ``pmap``), not
    ``vmap``'s. Not the value's batching alone: under ``vmap`` a value traced by
    ``jax.eval_shape`` (``optax.MultiSteps`` does it) is not batched, and JAX's
    invariant all-gather then fails an assertion on the ``vmap`` axis."""
    if _all_gather_invariant is None or _is_batched(x):
        return False
    return set(axes) <= set(_mesh.get_abstract_mesh().manual_axes)


def bound_axes() -> dict:
    """The axis names bound where this is traced, with their sizes."""
    return dict(_core.get_axis_env().axis_sizes)


def check_axes(axes: Axes, what: str = "axis_name") -> None:
    """Raise a NameError at trace time when an axis is not bound."""
    bound = bound_axes()
    missing = [a for a in axes if a not in bound]
    if missing:
        raise NameError(
            f"jaxsync: {what} {missing[0]!r} is not bound here; bound axes: "
            f"{bound or 'none (not inside shard_map, pmap or vmap)'}. Fix: call the "
            "transform inside jax.shard_map / jax.pmap / jax.vmap with "
            f"axis_name={missing[0]!r}, or pass the axis names that are bound."
        )


def _vmap_safe(together, each, axes: Axes):
    """``together(axes)``: one collective over every axis. JAX's vmap rules for
    ``psum_scatter`` and ``all_gather`` refuse several axes at once ("axis size
    doesn't match", nested ``vmap`` with a tuple ``axis_name``): there, ``each()``,
    the same collective one axis at a time, in the same layout (the first axis
    major). ``shard_map`` and ``pmap`` take the single collective."""
    if len(axes) < 2:
        return together(axes)
    try:
        return together(axes)
    except AssertionError as e:
        if "axis size doesn't match" not in str(e):
            raise
        return each()


def _gather_each(x, axes: Axes):
    """``all_gather`` over ``axes`` one at a time, the last first: shape
    ``(*sizes, *x.shape)``, the first axis major."""
    for a in reversed(axes):
        x = lax.all_gather(x, a, axis=0, tiled=False)
    return x


def axes_size(axes: Axes) -> int:
    n = 1
    for a in axes:
        n *= lax.axis_size(a)
    return n


class AxisOps:
    """Collectives over XLA axes (the intra-process stage, or a mesh backend)."""

    def __init__(self, axes: Axes, wire16: bool = False, unit_axes: Axes = ()):
        self.axes = tuple(axes)
        # Axes of size 1 left out of ``axes`` (nothing to reduce over them); the
        # inter-process stage types its results invariant over them.
        self.unit_axes = tuple(unit_axes)
        # False: 16-bit data is summed as float32 by one all-reduce (in-process
        # traffic). True: it travels as 16-bit payloads (see sum_buffers).
        self.wire16 = wire16

    @property
    def size(self) -> int:
        return axes_size(self.axes)

    def allreduce(self, bufs: list) -> list:
        if not self.axes or not bufs:
            return list(bufs)
        return list(lax.psum(list(bufs), self.axes))

    def alltoall(self, x):
        """``x`` has shape (size, m): row j goes to peer j; returns rows from peers."""
        if not self.axes:
            return x
        # An operand vmap left unmapped (a constant: double buffering's first
        # step sends init's zeros) comes back misshapen from jax's all_to_all
        # batching rule ((2, 3) -> (2, 3, 2, 3)): this makes it mapped (fused).
        x = x + (lax.axis_index(self.axes) * 0).astype(x.dtype)
        return lax.all_to_all(x, self.axes, 0, 0, tiled=True)

    def allgather(self, x):
        """``x`` of shape (m,) -> (size, m); the result is replicated."""
        if not self.axes:
            return x[None]
        if _invariant_gather(x, self.axes):
            return _all_gather_invariant(x, self.axes, axis=0, tiled=False)
        return _vmap_safe(
            lambda a: lax.all_gather(x, a, axis=0, tiled=False),
            lambda: _gather_each(x, self.axes).reshape(-1, *x.shape),
            self.axes,
        )

    def reduce_scatter(self, x):
        if not self.axes:
            return x

        def each():  # the first axis major, as one psum_scatter over them all
            y = x
            for a in self.axes:
                y = lax.psum_scatter(y, a, scatter_dimension=0, tiled=True)
            return y

        return _vmap_safe(
            lambda a: lax.psum_scatter(x, a, scatter_dimension=0, tiled=True), each, self.axes
        )

    def allgather_tiled(self, x):
        """Concatenate the slices of all members; the result is replicated."""
        if not self.axes:
            return x
        if _invariant_gather(x, self.axes):
            return _all_gather_invariant(x, self.axes, axis=0, tiled=True)
        return _vmap_safe(
            lambda a: lax.all_gather(x, a, axis=0, tiled=True),
            lambda: _gather_each(x, self.axes).reshape(-1, *x.shape[1:]),
            self.axes,
        )

    def broadcast(self, bufs: list, root: int = 0) -> list:
        if not self.axes:
            return bufs
        idx = lax.axis_index(self.axes)
        return [lax.psum(jnp.where(idx == root, b, jnp.zeros_like(b)), self.axes) for b in bufs]
