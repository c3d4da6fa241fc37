"""The islands' anchors compared at the first outer step: every island must
hold the same anchor (the same starting parameters, the same warm-up), and
parameters changed outside the transform on one island would otherwise drift
apart unnoticed. A 32-bit digest of this island's anchor travels as 32 values
0 or 1 through a lossless copy of the outer mean: the mean of each is 0 or 1
exactly when every island holds the same digest, and any other value is read
the same on every island (the decision comes from the synced mean), so every
island raises the same error at the same step.

May import: ``_core`` (``_sync.sync``), ``_comm._invariance``, ``compress._phase``
(the cond with the token chain), ``_state``; JAX, numpy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsync._comm import _invariance
from jaxsync._core._sync import sync
from jaxsync.compress._phase import _select_phase

from ._state import LocalConfig


def anchor_bits(leaves) -> jax.Array:
    """A digest of the float32 leaves' bits, as 32 float32 values 0 or 1."""
    h = jnp.uint32(0x811C9DC5)
    for x in leaves:
        u = lax.bitcast_convert_type(x.astype(jnp.float32).reshape(-1), jnp.uint32)
        pos = jnp.arange(u.size, dtype=jnp.uint32) * jnp.uint32(0x85EBCA77)
        mixed = (u ^ pos) * jnp.uint32(0x9E3779B1)
        mixed = mixed ^ (mixed >> 15)
        h = (h ^ jnp.sum(mixed, dtype=jnp.uint32)) * jnp.uint32(0x01000193)
    bits = (h >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    return bits.astype(jnp.float32)


def anchors_differ(cfg: LocalConfig, anchor, axes) -> jax.Array:
    """Whether the islands' anchors differ (a bool, the same on every island)."""
    c = dataclasses.replace(cfg.outer_mean, comm_dtype=None, quant=None, check_finite=False)
    bits = anchor_bits(anchor)
    if axes and set(_invariance._vma(lax.axis_index(axes))):
        bits = _invariance._varying(bits, axes)
    (m,), _ = sync([bits], c)
    bad = jnp.any((m != 0.0) & (m != 1.0))
    if cfg.slices is not None:  # each replica compared its slice: tell the island
        (b,), _ = sync([bad.astype(jnp.float32)[None]], cfg.slices)
        bad = b[0] > 0
    return bad


def check_at_first_outer_step(cfg: LocalConfig, n, step, anchor) -> None:
    """At local step ``n == every / fragments`` (the run's first outer step):
    compare the anchors, in a cond (the other steps send nothing)."""
    c = cfg.outer_mean
    axes = tuple(c.axes) + tuple(c.backend.mesh_axes)
    if cfg.slices is not None:
        axes += tuple(cfg.slices.axes) + tuple(cfg.slices.backend.mesh_axes)
    active = set(_invariance._vma(lax.axis_index(axes))) if axes else set()
    vma = tuple(sorted(active | {a for x in anchor for a in _invariance._vma(x)}, key=str))

    def check(a):
        bad = anchors_differ(cfg, a, tuple(x for x in axes if x in active))
        raise_if_differ(cfg, bad, step)
        return _invariance._varying(bad, vma)

    def quiet(a):
        return _invariance._varying(jnp.array(False), vma)

    _select_phase(n != cfg.every // cfg.fragments, quiet, check, anchor, c)


def raise_if_differ(cfg: LocalConfig, bad, step) -> None:
    """Raise on every island where ``bad`` (read from the synced mean)."""

    def check(bad, step):
        if np.asarray(bad).any():
            raise ValueError(
                f"jaxsync.{cfg.fn}: the islands' anchors differ at the first outer step "
                f"(step {int(np.asarray(step).ravel()[0])}): every island must start from "
                "the same parameters and change them only through this transform, or the "
                "islands average points that never were one model. Fix: "
                "jaxsync.broadcast_params(params) before the first step, and after changing "
                "parameters outside the transform (a restore, a re-initialised layer) make "
                "the change on every island alike."
            )

    jax.debug.callback(check, bad, step)
