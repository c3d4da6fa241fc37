"""``replica_mean``: the mean over every replica of non-gradient values (BatchNorm
statistics, metrics, a loss), each replica's own, across devices and processes.

ChainerMN's ``MultiNodeBatchNormalization`` / ``AllreducePersistent`` and Caffe2's
``broadcast_computed_params``. It runs ``_sync.sync`` (the hierarchical path: the
local axes, then the inter-process stage) with one difference from
``sync_gradients``: a value typed invariant over some axes under ``shard_map`` is
read as every replica's own equal value (its mean over those axes is itself),
not as a sum autodiff already took (a gradient's reading, see
``_invariance.share_invariant``).

Imports: ``_config`` (``make_config``), ``_sync`` (``sync``), ``_comm._intra``
and ``_comm._invariance``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxsync._comm import _intra, _invariance

from ._config import AUTO, AxisName, Comm, make_config
from ._sync import sync

PyTree = Any

_FLOATS = ("bfloat16", "float16", "float32", "float64")


def replica_mean(tree: PyTree, *, axis_name: AxisName, comm: Comm = AUTO) -> PyTree:
    """The mean over every replica (devices x processes) of per-replica values.

    For state that is not a gradient: BatchNorm statistics (flax's
    ``batch_stats``), metrics, the loss. Call it where the step runs (inside
    ``shard_map``, ``pmap``, ``vmap(axis_name=...)``, or plain ``jit`` with
    ``axis_name=None`` and one device per process); every replica gets the same
    result. Like :func:`jaxsync.sync_gradients` it reduces over the local axes
    and then across processes (``comm``), packed into few buffers.

    Warning:
      The input is **per replica**: each device's own statistics (its batch's
      mean and variance, its loss), not values already averaged or summed
      across devices. A value already averaged (``lax.pmean``) comes back
      unchanged: the mean of equal values is that value. A value already
      *summed* (``lax.psum``, or under ``shard_map`` the gradient of a
      replicated parameter, which autodiff sums over the devices) is not divided
      either: for gradients use :func:`jaxsync.sync_gradients` or the optax
      factories, which read such a value as a sum.

    Under ``shard_map`` the axis types say which values are already equal on
    every device (``jax.typeof(x)``: not varying over an axis). Such a leaf is
    left as it is over those axes, bit for bit (flax's
    ``BatchNorm(axis_name=...)`` statistics, ``lax.pmean`` results); with
    several processes the processes' values are averaged. ``sync_gradients``
    would divide it by the replica count again (it reads an invariant leaf as a
    sum of gradients). Under ``pmap``, ``vmap`` or ``check_vma=False`` values
    carry no such types: every leaf is averaged (equal values give themselves
    back, exactly for integer values and power-of-two replica counts).

    The mean of the replicas' variances is not the variance of the whole
    batch: for that average the mean and the mean of squares and take
    ``E[x^2] - E[x]^2`` (as ChainerMN's ``MultiNodeBatchNormalization`` does).

    Args:
      tree: a pytree of floating arrays (bfloat16, float16, float32, float64).
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      comm: the inter-process stage, as for :func:`jaxsync.mean`
        (``"auto"``: ``MPI.COMM_WORLD`` when launched by MPI with several
        processes, else ``None``).

    Returns:
      a tree of the same structure, shapes and dtypes: each leaf's mean over
      every replica, the same on every replica.

    Raises:
      TypeError: a leaf is not floating (an integer count: cast it, e.g.
        ``count.astype(jnp.float32)``, or sum it with ``jax.lax.psum``), a leaf
        is not an array (a function of an equinox model: pass the arrays only,
        e.g. ``eqx.filter(tree, eqx.is_array)``), or an argument has the wrong
        type.
      NameError: ``axis_name`` is not bound where it is traced.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> x = jnp.arange(16.0).reshape(4, 4)            # 4 replicas, 4 rows each
      >>> def stats(xb):
      ...     mine = {"mean": xb.mean(), "var": xb.var()}  # this replica's
      ...     return jaxsync.replica_mean(mine, axis_name="i", comm=None)
      >>> out = jax.vmap(stats, axis_name="i")(x)
      >>> out["mean"], out["var"]
      (Array([7.5, 7.5, 7.5, 7.5], dtype=float32), Array([1.25, 1.25, 1.25, 1.25], dtype=float32))
    """
    fn = "replica_mean"
    cfg = make_config(fn, "hierarchical", axis_name, comm)
    _check_leaves(fn, tree)
    _intra.check_axes(cfg.axes)
    axes = cfg.axes + tuple(cfg.backend.mesh_axes)
    typed = set(_invariance._vma(lax.axis_index(axes))) if axes else set()
    if not typed:  # no axis types (vmap, pmap, check_vma=False, plain jit)
        return sync(tree, cfg)[0]
    n = _intra.axes_size(cfg.axes) * cfg.backend.size()

    def invariant_size(x) -> int:
        have = _invariance._vma(x)
        return _intra.axes_size(tuple(a for a in axes if a in typed and a not in have))

    sizes = jax.tree.map(invariant_size, tree)
    # Equal on every replica there is: nothing to average, the leaf is the mean.
    # (Only without other replicas, so every process's tree is the same.)
    keep = jax.tree.map(lambda w: w == n, sizes)

    # Equal on the ``w`` replicas of the axes it is invariant over: it stands for
    # ``w`` equal values. sync keeps an invariant leaf on one of them and zeros on
    # the others (a gradient's reading, share_invariant), so it is scaled by ``w``
    # first: the sum over every replica is then right, and the mean too. A power
    # of two is exact to multiply by. float16 is scaled in float32 (w x may be
    # above float16's 65504) and rounded back once, after the mean.
    def scale(x, w, k):
        if k or w == 1:
            return None if k else x
        wide = jnp.float32 if str(x.dtype) == "float16" else x.dtype
        return x.astype(wide) * jnp.asarray(w, wide)

    # A kept leaf may still vary over axes of size 1 (a one-device mesh): the
    # mean of one value is that value, typed equal there by a psum over one.
    def kept(x):
        vary = tuple(a for a in axes if a in typed and a in _invariance._vma(x))
        return lax.psum(x, vary) if vary else x

    out = sync(jax.tree.map(scale, tree, sizes, keep), cfg)[0]
    return jax.tree.map(lambda x, k, y: kept(x) if k else y.astype(x.dtype), tree, keep, out)


def _check_leaves(fn: str, tree) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = jax.tree_util.keystr(path) or "tree"
        dt = getattr(leaf, "dtype", None)
        if dt is None:  # not an array: a function (an equinox model's), a Python number
            name = getattr(leaf, "__name__", None)
            got = type(leaf).__name__ + (f" {name}" if isinstance(name, str) else "")
            raise TypeError(
                f"{fn} got unexpected type for the leaf {where} (expected: a floating "
                f"array, one of {_FLOATS}, got: {got}, which is not an array). Fix: pass "
                "the arrays only, e.g. eqx.filter(tree, eqx.is_array) with equinox (its "
                "None leaves are left out; eqx.combine puts the rest back), or a tree of "
                "just the statistics to average."
            )
        if str(jnp.dtype(dt)) not in _FLOATS:
            raise TypeError(
                f"{fn} got unexpected type for the leaf {where} (expected: a floating "
                f"array, one of {_FLOATS}, got: {type(leaf).__name__} of dtype {dt}). Fix: "
                "cast it (e.g. count.astype(jnp.float32)) to average it, or sum integer "
                "counts with jax.lax.psum."
            )
