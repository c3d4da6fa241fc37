"""The public optax factories: one per strategy, each a thin typed front of
``_options.merge`` (``options=`` and the keywords), ``_config.make_config``
(validation when the factory is called) and ``_sync.transform_fns`` (the
init/update pair). The options' text and types are ``_options``'.

Imports: ``_config``, ``_options``, ``_sync`` and ``_join`` (weights=) only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import optax

from . import _join
from ._config import AUTO, make_config
from ._options import (
    MeanKeywords,
    NaiveKeywords,
    SingleNodeKeywords,
    SyncOptions,
    merge,
    takes,
)
from ._sync import transform_fns

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._config import AxisName, Comm


def _transform(fn: str, strategy: str, axis_name, comm, options, overrides):
    kw = merge(fn, options, overrides, takes=globals()[fn].takes)
    weights, early_termination = kw.pop("weights"), kw.pop("early_termination")
    cfg = make_config(fn, strategy, axis_name, comm, **kw)
    _join.check_early_termination(fn, early_termination, weights)
    if weights is not False:  # per-replica weights and the join (_join)
        fns = lambda c: transform_fns(fn, c)
        return _join.transform(fn, cfg, weights, fns, early_termination=early_termination)
    return optax.GradientTransformation(*transform_fns(fn, cfg))


@takes(NaiveKeywords)
def naive_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    options: SyncOptions | None = None,
    **overrides: Unpack[NaiveKeywords],
) -> optax.GradientTransformation:
    """Average gradients leaf by leaf.

    One reduction per leaf over the local axes, then one inter-process allreduce
    per leaf (ChainerMN ``naive``). Simple and the slowest with many small leaves.

    Args:
      axis_name, comm, options, **overrides: as for
        :func:`jaxsync.hierarchical_mean` (the options this one takes: ``help()``).

    Returns:
      an ``optax.GradientTransformation``, as :func:`jaxsync.hierarchical_mean`'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.naive_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    return _transform("naive_mean", "naive", axis_name, comm, options, overrides)


@takes(MeanKeywords)
def flat_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    options: SyncOptions | None = None,
    **overrides: Unpack[MeanKeywords],
) -> optax.GradientTransformation:
    """Average gradients packed into a few buffers.

    Every leaf is packed into one buffer per dtype (split into buckets of at
    most ``bucket_bytes``); one reduction over the local axes, one inter-process
    allreduce per buffer by local device 0, broadcast over the local axes
    (ChainerMN ``flat``).

    Args:
      axis_name, comm, options, **overrides: as for
        :func:`jaxsync.hierarchical_mean` (the options this one takes: ``help()``).

    Returns:
      an ``optax.GradientTransformation``, as :func:`jaxsync.hierarchical_mean`'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.flat_mean(axis_name="i", comm=None, reduce="sum")
      >>> g = {"b": jnp.ones(4), "w": jnp.arange(8.0).reshape(4, 2)}
      >>> out = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")(g)
      >>> out["b"], out["w"][0]  # one buffer on the wire, both leaves summed
      (Array([4., 4., 4., 4.], dtype=float32), Array([12., 16.], dtype=float32))
    """
    return _transform("flat_mean", "flat", axis_name, comm, options, overrides)


@takes(MeanKeywords)
def hierarchical_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    options: SyncOptions | None = None,
    **overrides: Unpack[MeanKeywords],
) -> optax.GradientTransformation:
    """Average gradients hierarchically.

    Sum over the local axes, one inter-process allreduce per process (by local
    device 0), broadcast back over the local axes (ChainerMN ``hierarchical``,
    Caffe2 ``_AllReduceBlobsDistributed``). The inter-process traffic is one
    buffer per process: the right default with several devices per process.

    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      comm: the inter-process stage: an mpi4py communicator, a
        :class:`jaxsync.AxisComm` (a mesh axis), ``None`` (one process) or
        ``"auto"`` (``MPI.COMM_WORLD`` when launched by MPI with several
        processes, else ``None``).
      options: the shared options, a :class:`jaxsync.SyncOptions` (``None``: its
        defaults); each option is documented there, once.
      **overrides: the same options as keywords (``reduce="sum"``, ...), each over
        ``options``; ``help()`` lists the ones this factory takes.

    Returns:
      an ``optax.GradientTransformation`` whose ``update`` returns the reduced
      gradients, the same on every replica. Its state is
      ``optax.EmptyState()``, or :class:`jaxsync.SyncState` with
      ``check_finite``, :class:`jaxsync.DoubleBufferState` with
      ``double_buffering``, :class:`jaxsync.WeightedState` with ``weights``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.hierarchical_mean(axis_name="i", comm=None),
      ...                  optax.sgd(1.0))
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([-1.5, -1.5, -1.5, -1.5], dtype=float32)
    """
    return _transform("hierarchical_mean", "hierarchical", axis_name, comm, options, overrides)


@takes(MeanKeywords)
def two_dimensional_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    options: SyncOptions | None = None,
    **overrides: Unpack[MeanKeywords],
) -> optax.GradientTransformation:
    """Average gradients two-dimensionally.

    Reduce-scatter over the local axes, every local device allreduces its slice
    across processes on its own communicator (the world split by local device
    index), all-gather over the local axes (ChainerMN ``two_dimensional``,
    Horovod hierarchical allreduce). Spreads inter-process traffic over all
    local devices.

    Args:
      axis_name, comm, options, **overrides: as for
        :func:`jaxsync.hierarchical_mean` (the options this one takes: ``help()``).

    Returns:
      an ``optax.GradientTransformation``, as :func:`jaxsync.hierarchical_mean`'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.two_dimensional_mean(axis_name="i", comm=None)
      >>> step = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")
      >>> g = {"w": jnp.arange(6.0).reshape(3, 2)}  # 3 replicas: slices padded to 3
      >>> step(g)["w"]
      Array([[2., 3.],
             [2., 3.],
             [2., 3.]], dtype=float32)
    """
    return _transform(
        "two_dimensional_mean", "two_dimensional", axis_name, comm, options, overrides
    )


@takes(SingleNodeKeywords)
def single_node_mean(
    axis_name: AxisName,
    *,
    options: SyncOptions | None = None,
    **overrides: Unpack[SingleNodeKeywords],
) -> optax.GradientTransformation:
    """Average gradients over the local axes only.

    One packed reduction over the devices of this process, no inter-process stage
    (ChainerMN ``single_node``, Caffe2 ``_AllReduceBlobsSingleHost``): it takes
    no ``comm``; use :func:`jaxsync.hierarchical_mean` across processes.

    Args:
      axis_name: as for :func:`jaxsync.hierarchical_mean`.
      options, **overrides: as for :func:`jaxsync.hierarchical_mean` (the
        options this factory takes: ``help()``).

    Returns:
      an ``optax.GradientTransformation``, as :func:`jaxsync.hierarchical_mean`'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.single_node_mean(axis_name="i")
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    return _transform("single_node_mean", "single_node", axis_name, None, options, overrides)
