"""``tie``: an ordering point between values that XLA:CPU keeps.

``tie(tree, after)`` returns ``tree``; every output depends on every input (of
both), so what reads an output waits for all inputs, and each input's memory
stays live until the tie. That is what ``lax.optimization_barrier`` means, but XLA:CPU removes
barriers before it schedules and assigns buffers (jax 0.10): the order they
were meant to impose is lost. Overlap and double buffering need it (an
optimizer update must come after the backward, and the backward's temporaries
must not reuse the memory of a sum still in flight), so on CPU with the native
library loaded ``tie`` lowers to ``jaxsync_tie``, a call whose results are
aliased to its operands and which does nothing. Elsewhere (other platforms,
or no native library, where no asynchronous native sum can be in flight) it
lowers to an optimization barrier.

Imports: jax and ``_mpi_load``.
"""

from __future__ import annotations

import functools

import jax
from jax._src import dispatch as _dispatch
from jax._src.interpreters import ad, batching
from jax._src.lib.mlir.dialects import hlo
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _mpi_load

# (*keep, *after) -> keep: the first ``keep`` operands come back (aliased, or
# copied into fresh buffers with ``fresh=True``), the others are only read.
tie_p = Primitive("jaxsync_tie")
tie_p.multiple_results = True
tie_p.def_abstract_eval(lambda *xs, keep, fresh: xs[:keep])  # each output typed as its input
tie_p.def_impl(functools.partial(_dispatch.apply_primitive, tie_p))


def _barrier_lowering(ctx, *xs, keep, fresh=False):
    del ctx, fresh
    return hlo.OptimizationBarrierOp(xs).results[:keep]


def _cpu_lowering(ctx, *xs, keep, fresh):
    if not _mpi_load.native_loaded():
        return _barrier_lowering(ctx, *xs, keep=keep)
    aliases = None if fresh else {i: i for i in range(keep)}
    return jax.ffi.ffi_lowering("jaxsync_tie", operand_output_aliases=aliases)(ctx, *xs)


mlir.register_lowering(tie_p, _barrier_lowering)
mlir.register_lowering(tie_p, _cpu_lowering, platform="cpu")


def _tie_batching(args, dims, *, keep, fresh):
    return tie_p.bind(*args, keep=keep, fresh=fresh), dims[:keep]


batching.primitive_batchers[tie_p] = _tie_batching


def _tie_jvp(primals, tangents, *, keep, fresh):
    out = tie_p.bind(*primals, keep=keep, fresh=fresh)
    return out, [ad.instantiate_zeros(t) for t in tangents[:keep]]


ad.primitive_jvps[tie_p] = _tie_jvp


def tie(tree, after=(), fresh=False):
    """``tree`` unchanged, once every leaf of ``tree`` and ``after`` exists.

    Each leaf of ``tree`` comes back in the memory it had (no copy), and stays
    there until every leaf of ``after`` is computed; ``after`` is only read, so
    its buffers are not tied up. ``fresh=True`` copies the leaves into new
    buffers instead: a value defined after ``after``, which XLA may then place
    in the memory of an input that ``after`` was computed from (a donated one:
    one copy where XLA's copy insertion, blind to that order, makes two). See
    the module docstring.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsync._comm._tie import tie
      >>> a, b = jax.jit(tie)((jnp.ones(2), jnp.zeros(3)))
      >>> a.tolist(), b.tolist()
      ([1.0, 1.0], [0.0, 0.0, 0.0])
      >>> jax.jit(lambda x, y: tie(x, after=y))(jnp.ones(2), jnp.zeros(3)).tolist()
      [1.0, 1.0]
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    later = jax.tree_util.tree_leaves(after)
    if not leaves or not (len(leaves) > 1 or later):
        return tree
    out = tie_p.bind(*leaves, *later, keep=len(leaves), fresh=bool(fresh))
    return jax.tree_util.tree_unflatten(treedef, out)
