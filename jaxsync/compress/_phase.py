"""Running one of two branches on the step count with the MPI token chain kept
in order (``start_step`` of :func:`jaxsync.powersgd_mean`).

May import: ``_intra`` (``_is_batched``), ``_mpi_backend``, ``_native_prim`` and
``_ordering`` (the native token chain); JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsync._comm import _intra, _mpi_backend, _native_prim, _ordering


def _select_phase(pred, early, late, operand, cfg):
    """``early(operand)`` where ``pred`` else ``late(operand)``; both traced.

    A ``lax.cond`` when ``pred`` is one scalar for the whole program: every
    process takes the same branch (the count is the same everywhere), and the
    native MPI token chain is threaded through the cond so the calls of either
    branch keep their place in the step's order. Under ``vmap`` the count is
    batched: both branches run (every collective of both, on every process)
    and the results are selected.
    """
    if _intra._is_batched(pred):
        a, b = early(operand), late(operand)
        return jax.tree_util.tree_map(lambda x, y: jnp.where(pred, x, y), a, b)
    threaded = isinstance(cfg.backend, _mpi_backend.MPIBackend) and cfg.backend.native
    if not threaded:
        return lax.cond(pred, early, late, operand)
    # A token cannot cross lax.cond under shard_map, so the chain crosses it as
    # data: a native call with active=0 (it returns at once, no MPI) turns the
    # chain's token into a one-element buffer that depends on it, and back.
    world = jnp.int32(cfg.backend.comms.world.py2f())
    size = cfg.backend.comms.size

    def tie(token, value):
        token, (value,) = _native_prim.native_call(
            "allreduce", [value], token, world, jnp.int32(0), size
        )
        return token, value

    _, dep = tie(_ordering.chain_token(), jnp.zeros((1,), jnp.float32))

    def wrap(f):
        def branch(args):
            dep, x = args
            token, dep = tie(lax.create_token(), dep)
            _ordering.set_chain_token(token)
            y = f(x)
            _, dep = tie(_ordering.chain_token(), dep)
            return dep, y

        return branch

    dep, out = lax.cond(pred, wrap(early), wrap(late), (dep, operand))
    token, _ = tie(_ordering.chain_token(), dep)
    _ordering.set_chain_token(token)
    return out


def _check_phase_backend(fn, cfg, start_step):
    if (
        start_step > 0
        and isinstance(cfg.backend, _mpi_backend.MPIBackend)
        and cfg.backend.staging == "host"
    ):
        raise ValueError(
            f"{fn}: start_step={start_step} chooses between two sets of collectives "
            "at run time (lax.cond), which jaxsync orders only with staging='device' "
            "(its native target on CPU, mpi4jax's on GPU); this backend is "
            f"{cfg.backend!r}. Fix: start_step=0, or staging='device'."
        )
