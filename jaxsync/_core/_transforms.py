"""The public optax factories: :func:`mean` (the strategy by name), its presets
(``naive_mean``, ``flat_mean``, ``hierarchical_mean``, ``two_dimensional_mean``:
``mean`` with the strategy given, as optax's ``adam`` is a preset of its
transforms) and ``single_node_mean``. Each is a thin typed front of
``_options.merge`` (``options=`` and the keywords), ``_config.make_config``
(validation when the factory is called) and ``_sync.transform_fns`` (the
init/update pair). The options' text and types are ``_options``'.

Imports: ``_config``, ``_options``, ``_sync`` and ``_join`` (weights=) only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Concatenate, Literal, ParamSpec, TypeVar

import optax

from . import _join
from ._config import AUTO, make_config
from ._options import (
    MeanKeywords,
    NaiveKeywords,
    SingleNodeKeywords,
    SyncOptions,
    merge,
    names_of,
    takes,
)
from ._sync import transform_fns

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._config import AxisName, Comm

P = ParamSpec("P")
R = TypeVar("R")
Strategy = Literal["naive", "flat", "hierarchical", "two_dimensional"]
# the options each strategy takes (naive: no host tier, its leaves go one by one)
_TAKES: dict[str, tuple[str, ...]] = {
    "naive": names_of(NaiveKeywords),
    "flat": names_of(MeanKeywords),
    "hierarchical": names_of(MeanKeywords),
    "two_dimensional": names_of(MeanKeywords),
}


def _transform(
    fn: str, strategy: str, axis_name, comm, options, overrides, takes: Iterable[str]
) -> optax.GradientTransformation:
    kw = merge(fn, options, overrides, takes=takes)
    weights, early_termination = kw.pop("weights"), kw.pop("early_termination")
    cfg = make_config(fn, strategy, axis_name, comm, **kw)
    _join.check_early_termination(fn, early_termination, weights)
    if weights is not False:  # per-replica weights and the join (_join)
        fns = lambda c: transform_fns(fn, c)
        return _join.transform(fn, cfg, weights, fns, early_termination=early_termination)
    return optax.GradientTransformation(*transform_fns(fn, cfg))


@takes(MeanKeywords)
def mean(
    strategy: Strategy,
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    options: SyncOptions | None = None,
    **overrides: Unpack[MeanKeywords],
) -> optax.GradientTransformation:
    """Average gradients across every replica, by the strategy named.

    ``mean("flat", ...)`` is :func:`jaxsync.flat_mean` ``(...)``, and so on: each
    strategy is also a factory of its own (a preset), which says how it moves
    the data. :func:`jaxsync.single_node_mean` (no inter-process stage) and
    :func:`jaxsync.auto_mean` (the strategy the cost model predicts fastest) are
    factories of their own.

    Args:
      strategy: ``"naive"`` (:func:`jaxsync.naive_mean`: leaf by leaf; it takes
        no ``host_tier``), ``"flat"`` (:func:`jaxsync.flat_mean`),
        ``"hierarchical"`` (:func:`jaxsync.hierarchical_mean`) or
        ``"two_dimensional"`` (:func:`jaxsync.two_dimensional_mean`).
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
        ``options``; ``help()`` lists them.

    Returns:
      an ``optax.GradientTransformation`` whose ``update`` returns the reduced
      gradients, the same on every replica. Its state is
      ``optax.EmptyState()``, or :class:`jaxsync.SyncState` with
      ``check_finite``, :class:`jaxsync.DoubleBufferState` with
      ``double_buffering``, :class:`jaxsync.WeightedState` with ``weights``.

    Raises:
      ValueError: ``strategy`` is none of the four (or an option is invalid, as
        :class:`jaxsync.SyncOptions` says).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.mean("hierarchical", axis_name="i", comm=None),
      ...                  optax.sgd(1.0))
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([-1.5, -1.5, -1.5, -1.5], dtype=float32)
    """
    if not isinstance(strategy, str) or strategy not in _TAKES:
        raise ValueError(
            f"mean: unexpected strategy; expected one of {', '.join(map(repr, _TAKES))}; "
            f"given: {strategy!r}. Fix: e.g. mean('hierarchical', ...); "
            "jaxsync.single_node_mean and jaxsync.auto_mean are factories of their own."
        )
    fn = f"{strategy}_mean"  # the name its errors and description give, as its preset's
    return _transform(fn, strategy, axis_name, comm, options, overrides, _TAKES[strategy])


_PRESET_ARGS = """
    Args:
      axis_name, comm, options, **overrides: as for :func:`jaxsync.mean` (the
        options {fn} takes: ``help()``).

    Returns:
      an ``optax.GradientTransformation``, as :func:`jaxsync.mean`'s.
"""


def _preset(
    of: Callable[Concatenate[Strategy, P], R], strategy: Strategy, doc: str
) -> Callable[P, R]:
    """:func:`mean` (``of``) with ``strategy`` given: a factory named
    ``<strategy>_mean``, its signature ``mean``'s without ``strategy`` and with the
    options its strategy takes (``help()``); its docstring ``doc`` (what the
    strategy does, an example) with the Args and Returns of a preset."""
    fn, names = f"{strategy}_mean", _TAKES[strategy]
    at = doc.index("\n    Example:\n")
    doc = doc[:at] + _PRESET_ARGS.format(fn=fn) + doc[at:]

    def preset(axis_name, comm=AUTO, *, options=None, **overrides):
        return of(strategy, axis_name, comm, options=options, **overrides)

    sig = inspect.signature(of)
    params = [
        p
        for n, p in sig.parameters.items()
        if n != "strategy" and (p.kind is not p.KEYWORD_ONLY or n == "options" or n in names)
    ]
    preset.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    preset.__name__ = preset.__qualname__ = fn
    preset.__doc__ = doc
    preset.takes = names  # type: ignore[attr-defined]
    return preset  # type: ignore[return-value]


naive_mean = _preset(
    mean,
    "naive",
    """Average gradients leaf by leaf: :func:`jaxsync.mean` with ``"naive"``.

    One reduction per leaf over the local axes, then one inter-process allreduce
    per leaf (ChainerMN ``naive``). Simple and the slowest with many small leaves.
    It takes every option but ``host_tier``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.naive_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """,
)

flat_mean = _preset(
    mean,
    "flat",
    """Average gradients packed into a few buffers: :func:`jaxsync.mean` with ``"flat"``.

    Every leaf is packed into one buffer per dtype (split into buckets of at
    most ``bucket_bytes``); one reduction over the local axes, one inter-process
    allreduce per buffer by local device 0, broadcast over the local axes
    (ChainerMN ``flat``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.flat_mean(axis_name="i", comm=None, reduce="sum")
      >>> g = {"b": jnp.ones(4), "w": jnp.arange(8.0).reshape(4, 2)}
      >>> out = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")(g)
      >>> out["b"], out["w"][0]  # one buffer on the wire, both leaves summed
      (Array([4., 4., 4., 4.], dtype=float32), Array([12., 16.], dtype=float32))
    """,
)

hierarchical_mean = _preset(
    mean,
    "hierarchical",
    """Average gradients hierarchically: :func:`jaxsync.mean` with ``"hierarchical"``.

    Sum over the local axes, one inter-process allreduce per process (by local
    device 0), broadcast back over the local axes (ChainerMN ``hierarchical``,
    Caffe2 ``_AllReduceBlobsDistributed``). The inter-process traffic is one
    buffer per process: the right default with several devices per process.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.hierarchical_mean(axis_name="i", comm=None),
      ...                  optax.sgd(1.0))
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([-1.5, -1.5, -1.5, -1.5], dtype=float32)
    """,
)

two_dimensional_mean = _preset(
    mean,
    "two_dimensional",
    """Average gradients two-dimensionally: :func:`jaxsync.mean` with ``"two_dimensional"``.

    Reduce-scatter over the local axes, every local device allreduces its slice
    across processes on its own communicator (the world split by local device
    index), all-gather over the local axes (ChainerMN ``two_dimensional``,
    Horovod hierarchical allreduce). Spreads inter-process traffic over all
    local devices.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.two_dimensional_mean(axis_name="i", comm=None)
      >>> step = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")
      >>> g = {"w": jnp.arange(6.0).reshape(3, 2)}  # 3 replicas: slices padded to 3
      >>> step(g)["w"]
      Array([[2., 3.],
             [2., 3.],
             [2., 3.]], dtype=float32)
    """,
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
    no ``comm``; use :func:`jaxsync.mean` across processes.

    Args:
      axis_name: as for :func:`jaxsync.mean`.
      options, **overrides: as for :func:`jaxsync.mean` (the
        options this factory takes: ``help()``).

    Returns:
      an ``optax.GradientTransformation``, as :func:`jaxsync.mean`'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.single_node_mean(axis_name="i")
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    fn, takes = "single_node_mean", single_node_mean.takes  # type: ignore[attr-defined]
    return _transform(fn, "single_node", axis_name, None, options, overrides, takes)
