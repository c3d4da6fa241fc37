"""Parameter broadcast: every process starts from the root's values."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync._comm import _abort
from jaxsync._comm._agree import _disagreement
from jaxsync._comm._axis_backend import AxisComm
from jaxsync._comm._topology import Comms, default_comm

from ._plan import structure_text

PyTree = Any


def broadcast_params(tree: PyTree, root: int = 0, comm: Any = "auto") -> PyTree:
    """Return ``tree`` with every leaf replaced by the root process's value.

    Call it eagerly (outside ``jit``) on every process, e.g. on the initial
    parameters and optimizer state (Caffe2 ``_SyncAllParamsDistributed``,
    ChainerMN ``bcast_data``, Horovod ``broadcast_parameters``). Each leaf keeps
    its dtype, shape and, for ``jax.Array`` leaves, its sharding; every device of
    every process then holds the root's value. Before any data moves, the
    processes check that their trees agree; if not, every process raises the
    same ``ValueError``.

    Leaves that are not arrays behave the same with one process and with many:
    a Python ``bool``, ``int``, ``float`` or ``complex`` gets the root's value
    and keeps its type; any other leaf without a dtype (a function such as
    ``jax.nn.relu`` in an equinox model, a string) is static, passed through
    unchanged (its type and name must agree across processes). A leaf that has
    a dtype but no values here (a tracer under ``jit``, a
    ``jax.ShapeDtypeStruct``, an array of another library) is refused, naming
    its path.

    Args:
      tree: a pytree of arrays (any dtype, including ints and bools), Python
        scalars and static leaves (an equinox model as it is).
      root: the rank whose values win.
      comm: an mpi4py communicator, ``jaxsync.AxisComm`` (then
        ``jax.distributed`` processes are used and ``root`` must be 0), ``None``
        (a single process: returns ``tree``) or ``"auto"``.

    Returns:
      a tree of the same structure, dtypes, shapes and shardings holding the
      root's values, the same on every process.

    Raises:
      TypeError: a leaf can be neither broadcast nor passed through (the error
        names its path and the fix), or ``root`` is not an int.
      ValueError: the processes' trees differ, or ``root`` is out of range.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> jaxsync.broadcast_params({"w": jnp.ones(2)}, comm=None)
      {'w': Array([1., 1.], dtype=float32)}
      >>> out = jaxsync.broadcast_params({"act": jax.nn.relu, "p": 0.5}, comm=None)
      >>> out["act"] is jax.nn.relu, out["p"]
      (True, 0.5)
    """
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(
            f"broadcast_params got unexpected type for argument 'root' "
            f"(expected: int, got: {type(root).__name__})."
        )
    if isinstance(comm, str) and comm == "auto":
        comm = default_comm()
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    kinds = [_kind(leaf) for _, leaf in with_paths]
    if comm is None:
        if root != 0:
            raise ValueError(
                f"broadcast_params: root={root} but there is one process (comm=None). Fix: root=0."
            )
        _raise_refused(with_paths, kinds)
        return tree
    leaves = [leaf for _, leaf in with_paths]
    if isinstance(comm, AxisComm):
        if root != 0:
            raise ValueError(
                "broadcast_params with AxisComm broadcasts from process 0; "
                f"got root={root}. Fix: root=0."
            )
        _raise_refused(with_paths, kinds)
        from jax.experimental import multihost_utils

        moving = [i for i, k in enumerate(kinds) if k != _STATIC]
        sent = [_scalar_words(leaves[i]) if kinds[i] == _SCALAR else leaves[i] for i in moving]
        got = multihost_utils.broadcast_one_to_all(sent)
        out = list(leaves)
        for i, new in zip(moving, got):
            out[i] = _restore(leaves[i], kinds[i], new)
        return jax.tree_util.tree_unflatten(treedef, out)
    size = comm.Get_size()
    _abort.install(comm)  # an uncaught exception ends the job, not only this process
    world = Comms.of(comm).control
    # The root first: a root that differs between processes is named as such
    # (each would wait in its own MPI_Bcast for ever); checked for range after
    # the exchange, so that a process whose root alone is wrong is no reason
    # for the others to wait.
    plan_text = f"root {int(root)}\n" + _describe(with_paths, kinds, treedef)
    # A 32-byte digest per process; the texts travel only on a mismatch.
    digests = world.allgather(hashlib.sha256(plan_text.encode()).digest())
    if len(set(digests)) > 1:
        raise ValueError(_disagreement(world.allgather(plan_text), "parameter tree"))
    if not 0 <= root < size:
        raise ValueError(f"broadcast_params: root must be in [0, {size}), got {root}.")
    _raise_refused(with_paths, kinds)  # the same leaves on every process: the same error
    out = []
    for leaf, kind in zip(leaves, kinds):
        if kind == _STATIC:
            out.append(leaf)
            continue
        host = _scalar_words(leaf) if kind == _SCALAR else np.array(leaf, copy=True)
        buf = host.reshape(-1).view(np.uint8) if host.size else host
        if host.size:
            world.Bcast(buf, root=root)
        out.append(_restore(leaf, kind, host))
    return jax.tree_util.tree_unflatten(treedef, out)


# What broadcast_params does with a leaf (``_kind``).
_ARRAY = "array"  # a jax.Array, numpy array or numpy scalar: its bytes are sent
_SCALAR = "python"  # a Python bool, int, float or complex: its value is sent, its type kept
_STATIC = "static"  # no dtype (a function, a string): passed through unchanged
_SCALAR_DTYPES = {complex: np.complex128, float: np.float64}  # else int64 (bool, int)


def _kind(leaf) -> str:
    """``_ARRAY``, ``_SCALAR``, ``_STATIC``, or the reason the leaf is refused."""
    if isinstance(leaf, jax.core.Tracer):
        return (
            "a traced value (broadcast_params runs eagerly, outside jit). Fix: call it "
            "outside jit, shard_map and grad, on the concrete parameters"
        )
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        if np.dtype(leaf.dtype).hasobject:
            return _refusal(leaf, "a numpy array of Python objects")
        return _ARRAY
    if isinstance(leaf, (bool, int, float, complex)):
        if isinstance(leaf, int) and not -(2**63) <= leaf < 2**63:
            return _refusal(leaf, "a Python int outside int64")
        return _SCALAR
    if hasattr(leaf, "dtype") or hasattr(leaf, "__array__"):
        return _refusal(leaf, "a value with a dtype but not a jax or numpy array")
    return _STATIC


def _refusal(leaf, what: str) -> str:
    return (
        f"{what} ({type(leaf).__module__}.{type(leaf).__qualname__}); expected a jax.Array, "
        "a numpy array, a Python scalar, or a static leaf without a dtype (a function), "
        "passed through unchanged. Fix: convert it (jnp.asarray), or broadcast the "
        "arrays alone: arrays, rest = eqx.partition(model, eqx.is_array) (or "
        "eqx.filter(model, eqx.is_array)), then eqx.combine(broadcast_params(arrays), rest)"
    )


def _raise_refused(with_paths, kinds) -> None:
    for (path, _), kind in zip(with_paths, kinds):
        if kind not in (_ARRAY, _SCALAR, _STATIC):
            raise TypeError(
                f"broadcast_params cannot broadcast the leaf "
                f"{jax.tree_util.keystr(path) or 'tree'}: it is {kind}."
            )


def _scalar_words(x) -> np.ndarray:
    """A Python scalar as 32-bit words of its 64-bit (128 for complex) value: the
    same bits on every transport (no float32 rounding without x64)."""
    dt = next((d for t, d in _SCALAR_DTYPES.items() if isinstance(x, t)), np.int64)
    return np.array([x], dt).view(np.uint32)


def _restore(old, kind: str, new):
    """The broadcast value ``new`` as a leaf like ``old``: type, dtype, sharding."""
    if kind == _SCALAR:
        dt = next((d for t, d in _SCALAR_DTYPES.items() if isinstance(old, t)), np.int64)
        return type(old)(np.asarray(new, np.uint32).view(dt)[0].item())
    if isinstance(old, jax.Array):
        sharding = getattr(old, "sharding", None)
        # broadcast_one_to_all returns host arrays: each goes back where it was
        # (its sharding), not on the default device.
        return jax.device_put(new, sharding) if sharding is not None else jnp.asarray(new)
    if isinstance(old, np.generic):
        return np.asarray(new, old.dtype)[()]  # a numpy scalar stays one
    return np.asarray(new)


def _describe(with_paths, kinds, treedef) -> str:
    lines = []
    for (path, leaf), kind in zip(with_paths, kinds):
        where = jax.tree_util.keystr(path)
        if kind == _ARRAY:
            # Shapes and dtypes from the leaf itself: no copy to host.
            lines.append(f"leaf {where} {np.shape(leaf)} {np.dtype(leaf.dtype)}")
        elif kind == _SCALAR:
            lines.append(f"leaf {where} python {type(leaf).__name__}")
        else:  # static (its type and name, never its repr: addresses differ), or refused
            name = getattr(leaf, "__qualname__", None) if kind == _STATIC else None
            name = f" {getattr(leaf, '__module__', '')}.{name}" if isinstance(name, str) else ""
            what = "static" if kind == _STATIC else "refused"
            lines.append(
                f"leaf {where} {what} {type(leaf).__module__}.{type(leaf).__qualname__}{name}"
            )
    # Last: the first differing line names a leaf.
    lines.append(f"treedef {structure_text(treedef)}")
    return "\n".join(lines)
