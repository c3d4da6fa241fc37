"""``accumulate``: gradient accumulation that synchronises once per ``k``
micro-steps.

``optax.MultiSteps(optax.chain(jaxsync...mean(...), opt), k)`` runs the
wrapped update, and so the synchronisation, at every micro-step. Here each
replica adds its micro-step's gradients to a local accumulator (nothing
travels), and at every ``k``-th call the wrapped transform (a jaxsync chain)
runs once on the accumulated mean. The choice is made by ``lax.cond`` on the
call count, which is the same on every replica (each calls ``update`` once per
micro-step), so every replica issues the synchronisation at the same call;
jaxsync orders a synchronisation inside ``lax.cond`` with the others of the
step (``_comm._ordering``).

Imports: ``_comm._intra`` (bound axes), ``_comm._invariance`` (axis types),
``_config`` (``make_config``, ``ACCUMULATE``: ``k`` in the agreed text).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxsync._comm import _intra, _invariance

from ._config import ACCUMULATE, AxisName, check_count, check_transformation, make_config


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tree"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _Local:
    """A replica's own values (the accumulator): split over the local axes by
    :func:`jaxsync.state_specs`. Each leaf has a leading axis of 1, so a
    scalar gradient's accumulator can be stacked along it too."""

    tree: Any

    def jaxsync_state_specs(self, per_replica, replicated):
        del replicated
        return _Local(jax.tree.map(lambda _: per_replica, self.tree))


class AccumulateState(NamedTuple):
    """State of :func:`jaxsync.accumulate`.

    Attributes:
      mini_step: micro-steps accumulated since the last synchronisation (the
        same on every replica).
      acc: this replica's sum of those micro-steps' gradients (each leaf
        ``(1, *shape)``; per replica under ``shard_map``: lay it out with
        :func:`jaxsync.state_specs`).
      inner: the wrapped transform's state.
    """

    mini_step: jax.Array
    acc: Any
    inner: Any


def accumulate(
    tx: optax.GradientTransformation, every: int, *, axis_name: AxisName
) -> optax.GradientTransformationExtraArgs:
    """Accumulate gradients locally; synchronise and apply once per ``every`` calls.

    ``tx`` is a jaxsync chain, e.g. ``optax.chain(jaxsync.hierarchical_mean(...),
    optax.adam(1e-3))``. Micro-steps ``1 .. every - 1`` add this replica's
    gradients to a local accumulator and return zero updates (nothing
    travels); micro-step ``every`` runs ``tx`` once on the accumulated mean
    (``sum / every``) and returns its updates. Compared with
    ``optax.MultiSteps(tx, every)``, which synchronises at every micro-step:
    ``1 / every`` of the bytes and calls, for a full-size accumulator per
    replica (MultiSteps keeps one too). The trade against reduce-scattering
    every micro-step into 1/N accumulators (ZeRO-2) is in docs/accumulation.md.

    Non-finite micro-steps: a NaN or infinity in any replica's micro-step
    makes that accumulation's mean non-finite on every replica (the sum
    carries it); put ``optax.apply_if_finite`` after the mean inside ``tx``
    (``optax.chain(mean, optax.apply_if_finite(opt, n))``) to skip the whole
    accumulated step on every replica at once. The accumulation's boundaries
    never move: every ``every``-th call synchronises, on every replica.

    Args:
      tx: the transformation to run on the accumulated mean (it holds the
        synchronisation).
      every: micro-steps per synchronisation (an int >= 1).
      axis_name: the local axis name(s) of the step, as for ``tx``'s mean
        (``None`` under plain ``jit``): a gradient typed invariant under
        ``shard_map`` (already summed by autodiff) is accumulated on one device.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` with an
      :class:`AccumulateState`.

    Raises:
      ValueError: ``every`` is not an int >= 1.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> sync = jaxsync.hierarchical_mean(axis_name="i", comm=None)
      >>> tx = jaxsync.accumulate(optax.chain(sync, optax.sgd(1.0)), 2, axis_name="i")
      >>> def two(g1, g2):
      ...     s = tx.init(g1)
      ...     u1, s = tx.update(g1, s)  # local only: zeros
      ...     u2, s = tx.update(g2, s)  # the mean of 2 micro-steps x 4 replicas
      ...     return u1, u2
      >>> u1, u2 = jax.vmap(two, axis_name="i")(jnp.arange(4.0), jnp.arange(4.0) + 4)
      >>> u1, u2
      (Array([0., 0., 0., 0.], dtype=float32), Array([-3.5, -3.5, -3.5, -3.5], dtype=float32))
    """
    fn = "accumulate"
    check_count(
        fn,
        "every",
        every,
        "micro-steps per synchronisation",
        "jaxsync.accumulate(tx, 4, axis_name=...)",
    )
    check_transformation(
        fn,
        "tx",
        tx,
        "jaxsync.accumulate(optax.chain(jaxsync.hierarchical_mean(...), optax.adam(1e-3)), "
        "4, axis_name=...)",
    )
    axes = make_config(fn, "hierarchical", axis_name, None).axes
    tx = optax.with_extra_args_support(tx)

    def init_fn(params):
        acc = jax.tree.map(lambda p: jnp.zeros((1, *jnp.shape(p)), jnp.result_type(p)), params)
        return AccumulateState(jnp.zeros([], jnp.int32), _Local(acc), tx.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        local = _own(updates, axes)
        acc = jax.tree.map(lambda a, g: a + g[None].astype(a.dtype), state.acc.tree, local)
        seen: list = []

        def sync(acc, inner):
            mean = jax.tree.map(lambda a, g: (a[0] / every).astype(g.dtype), acc, updates)
            reset = ACCUMULATE.set(every)  # named in the synchronisation's agreed text
            try:
                out, inner = tx.update(mean, inner, params, **extra_args)
            finally:
                ACCUMULATE.reset(reset)
            seen.append(out)
            return out, inner, jax.tree.map(jnp.zeros_like, acc)

        def wait(acc, inner):
            # Zero updates typed as the synchronising branch's (lax.cond traces
            # the true branch first): under shard_map its axis types too.
            if not seen:
                raise RuntimeError(f"{fn}: internal: the synchronising branch was not traced first")
            zeros = jax.tree.map(
                lambda x: _invariance._varying(jnp.zeros(x.shape, x.dtype), _invariance._vma(x)),
                seen[0],
            )
            return zeros, inner, acc

        last = state.mini_step == every - 1
        out, inner, acc = lax.cond(last, sync, wait, acc, state.inner)
        step = jnp.where(last, 0, state.mini_step + 1).astype(jnp.int32)
        return out, AccumulateState(step, _Local(acc), inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _own(tree, axes):
    """Gradients as this replica's own: one typed invariant under ``shard_map``
    (autodiff summed it over the devices) is kept on one device, zero on the
    others, so that the sum over the replicas counts it once."""
    if not axes or not all(a in _intra.bound_axes() for a in axes):
        return tree
    return _invariance.share_invariant(tree, axes)
