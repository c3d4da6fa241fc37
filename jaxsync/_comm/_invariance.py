"""shard_map's axis types: which values are varying or invariant over which axes.

``_vma`` reads the axes a value is typed as varying over, ``_varying`` marks it
varying over more, and ``share_invariant`` makes a gradient that autodiff
already summed (invariant) take part in a sum once. Used by the strategies'
entry points, the MPI backend, the ordering ties and the agreement check.

Imports: jax and ``_intra`` (axis sizes) only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._intra import Axes, axes_size


def share_invariant(tree, axes: Axes):
    """Gradients that autodiff already summed over some axes take part once.

    Under ``shard_map`` (with ``check_vma``), the gradient of a parameter that
    entered replicated (``in_specs=P()``) comes out *invariant* over the mesh
    axes: autodiff already summed the per-device gradients. Summing it again
    would multiply it by the axis size. Such a leaf keeps its value on device 0
    of the axes it is invariant over and becomes zero on the others, so the
    usual sum counts it exactly once and the mean stays right (bit-exact: adding
    zeros changes only the sign of a zero).
    """
    if not axes:
        return tree
    typed = set(_vma(lax.axis_index(axes)))
    if not typed:  # vmap, pmap, or check_vma=False: values carry no axis types
        return tree

    def share(x):
        if str(x.dtype) not in ("float16", "bfloat16", "float32", "float64"):
            return x
        have = _vma(x)
        inv = tuple(a for a in axes if a in typed and a not in have)
        if not inv:
            return x
        if axes_size(inv) == 1:  # one member: it is counted once as it is
            return _varying(x, inv)
        first = lax.axis_index(inv) == 0
        return jnp.where(first, _varying(x, inv), jnp.zeros_like(x))

    return jax.tree.map(share, tree)


def _vma(x) -> tuple:
    """The shard_map axes over which ``x`` is typed as varying."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    vma = mat.varying if mat is not None else getattr(aval, "vma", ())
    return tuple(sorted(vma or (), key=str))


def _varying(x, axes):
    """Mark ``x`` as varying over ``axes`` (shard_map's manual-axis types)."""
    have = _vma(x)
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x
