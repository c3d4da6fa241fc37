"""The local-update methods' state, their static configuration and its checks.

``LocalConfig`` is what every factory of ``jaxsync.local`` validates once, when
it is called (errors name the argument, what was expected, what was given and
the fix); ``LocalUpdatesState`` is the optimizer state they share.

May import: ``_core._config`` (``make_config``, ``_bad_type``) and ``_islands``;
JAX, optax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import optax

from jaxsync._comm import _mpi_backend
from jaxsync._core import _config
from jaxsync._core._overlap import bad_type

from ._islands import Islands, islands

PyTree = Any


class LocalUpdatesState(NamedTuple):
    """State of :func:`jaxsync.diloco`, :func:`jaxsync.local_sgd`, :func:`jaxsync.bmuf`.

    Attributes:
      step: inner steps taken (int32), the same on every island.
      anchor: the outer parameters, float32, identical on every island (with
        ``slice_anchor=True``, this replica's slice of each leaf).
      outer_state: the outer optimizer's state (identical on every island).
      inner_state: the inner optimizer's state, kept across outer steps.
      skipped: outer steps skipped because the averaged pseudo-gradient was not
        finite (the same count on every island).
      held: streaming with ``delay``: each fragment's outer mean, taken at its
        send step and applied ``delay`` steps later (``()`` without delay).
      diverged: this island's flag per fragment (bool, shape ``(fragments,)``):
        an inner step gave non-finite parameters, which were kept from the
        parameters; set until the fragment's next outer step sends it back to
        the anchor (the island idles while any is set). ``()`` in states made
        before it existed.
    """

    step: jax.Array
    anchor: PyTree
    outer_state: Any
    inner_state: Any
    skipped: jax.Array
    held: Any = ()
    diverged: Any = ()


@dataclasses.dataclass(frozen=True, eq=False)
class LocalConfig:
    fn: str
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    every: int
    islands: Islands
    sync: Any  # the outer mean's SyncConfig (check_finite=True)
    warmup: int = 0
    reset_inner: bool = False
    fragments: int = 1
    labels: Any = None  # a pytree of ints in [0, fragments), or None (strided)
    mix: float = 0.0
    delay: int = 0
    lane: Any = None  # overlap=True: the outer communicator's lane (_inflight)
    # slice_anchor=True: the island's replicas' SyncConfig (each holds 1/R of the
    # anchor and outer state; the new anchor is all-gathered over it at an outer
    # step), and the outer mean's, over the islands only (each replica with its
    # peers of the same slice)
    slices: Any = None
    outer_sync: Any = None
    # every process of the job (Islands.world): the MPIBackend the configuration
    # is agreed over (_update._agree), or None (one process, a mesh axis)
    world: Any = None

    @property
    def outer_mean(self):
        """The outer mean's SyncConfig (over the islands only when sliced)."""
        return self.outer_sync if self.outer_sync is not None else self.sync

    def describe(self) -> str:
        return (
            f"{self.fn} every {self.every} warmup {self.warmup} reset_inner "
            f"{self.reset_inner} fragments {self.fragments} mix {self.mix} delay "
            f"{self.delay} overlap {self.lane is not None} sliced {self.slices is not None} "
            f"{self.islands.describe()}"
        )


def _int(fn, name, value, low, fix):
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(fn, name, "a Python int", value, fix)
    if value < low:
        raise ValueError(f"{fn}: {name} must be >= {low}, got {value}. Fix: {fix}.")
    return value


def _tx(fn, name, value, fix):
    if not isinstance(value, optax.GradientTransformation):
        raise bad_type(fn, name, "an optax.GradientTransformation", value, fix)
    return value


def make_local_config(
    fn: str,
    inner,
    *,
    outer,
    every,
    islands_,
    strategy="hierarchical",
    comm_dtype=None,
    timeout=None,
    warmup=0,
    reset_inner=False,
    fragments=1,
    labels=None,
    mix=0.0,
    delay=0,
    overlap=False,
    slice_anchor=False,
) -> LocalConfig:
    """Validate every static option of a local-update factory."""
    _tx(fn, "inner", inner, "pass the whole inner optimizer, e.g. optax.chain(mean, adam)")
    _tx(fn, "outer", outer, "pass e.g. outer=optax.sgd(0.7, momentum=0.9, nesterov=True)")
    every = _int(fn, "every", every, 1, "every=H, the inner steps between outer steps (>= 1)")
    warmup = _int(fn, "warmup", warmup, 0, "warmup=0 (none) or a step count")
    fragments = _int(fn, "fragments", fragments, 1, "fragments=1 (DiLoCo) or P >= 1")
    delay = _int(fn, "delay", delay, 0, "delay=0, or tau < every // fragments")
    if every % fragments:
        raise ValueError(
            f"{fn}: every={every} is not a multiple of fragments={fragments}: the "
            "fragments sync in turn, one every every/fragments steps. Fix: every="
            f"{fragments * max(1, round(every / fragments))}, or fragments dividing {every}."
        )
    if delay >= every // fragments:
        raise ValueError(
            f"{fn}: delay={delay} must be < every/fragments={every // fragments} (a "
            "fragment's mean must land before the same fragment is sent again). "
            f"Fix: delay <= {every // fragments - 1}, or a larger every."
        )
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix <= 1.0:
        raise ValueError(
            f"{fn}: mix must be a Python float in [0, 1], got {mix!r}. Fix: mix=0.0 "
            "(the outer result replaces the fragment) or e.g. mix=0.5."
        )
    if not isinstance(reset_inner, bool):
        raise bad_type(fn, "reset_inner", "a bool", reset_inner, "reset_inner=False")
    if islands_ is None:
        islands_ = islands()
    elif not isinstance(islands_, Islands):
        islands_ = islands(islands_)
    sync = _config.make_config(
        fn,
        strategy,
        islands_.axis_name,
        islands_.outer_comm,
        comm_dtype=comm_dtype,
        check_finite=True,
        timeout=timeout,
    )
    if isinstance(sync.backend, _mpi_backend.MPIBackend) and sync.backend.staging == "host":
        # The outer mean sits in a lax.cond on the step count, whose MPI calls
        # jaxsync orders on its device-staged paths only (native, mpi4jax).
        raise ValueError(
            f"{fn}: the outer mean runs every {every} steps inside a lax.cond, which "
            "jaxsync orders only with staging='device' (its native target on CPU, "
            f"mpi4jax's on GPU); this backend is {sync.backend!r}. Fix: "
            "staging='device', or islands as a mesh axis (jaxsync.AxisComm)."
        )
    slices, outer_sync = _sliced(fn, islands_, slice_anchor, strategy, comm_dtype, timeout)
    lane = None
    if not isinstance(overlap, bool):
        raise bad_type(fn, "overlap", "a bool", overlap, "overlap=False or overlap=True")
    if overlap and sync.quant is not None:
        raise ValueError(
            f"{fn}: overlap=True sends the mean in flight in float32 or a 16-bit "
            f"comm_dtype; a quantized wire (comm_dtype={comm_dtype!r}) is not supported "
            "there yet. Fix: overlap=False (the held form takes the quantized mean) or "
            "comm_dtype=jnp.bfloat16."
        )
    if overlap and slices is not None:
        raise ValueError(
            f"{fn}: overlap=True with slice_anchor=True is not supported yet (the "
            "skip decision of a sliced mean in flight needs the island's replicas). "
            "Fix: overlap=False (the held form) or slice_anchor=False."
        )
    if overlap and isinstance(sync.backend, _mpi_backend.MPIBackend) and not sync.backend.native:
        raise ValueError(
            f"{fn}: overlap=True keeps the outer mean in flight across steps in "
            "jaxsync's native library, which runs on CPU only; this backend is "
            f"{sync.backend!r} (mpi4jax's targets, which block: nothing would "
            "overlap). Fix: overlap=False (the held form, which delay= still "
            "staggers), or islands as a mesh axis (jaxsync.AxisComm: NCCL on GPU)."
        )
    if overlap:
        outer_comm = islands_.outer_comm
        if not delay or islands_.axis_name is not None or not hasattr(outer_comm, "Allreduce"):
            raise ValueError(
                f"{fn}: overlap=True needs delay >= 1 (got {delay}), one device per "
                f"process (the islands' axis_name None, got {islands_.axis_name!r}) and "
                f"islands across processes (an MPI outer communicator, got {outer_comm!r}). "
                "Fix: delay=1 or more and islands=jaxsync.islands('process'), or "
                "overlap=False (the mean taken at the send step and held)."
            )
        from ._inflight import lane as _lane

        lane = _lane(outer_comm)
    return LocalConfig(
        fn,
        inner,
        outer,
        every,
        islands_,
        sync,
        warmup=warmup,
        reset_inner=reset_inner,
        fragments=fragments,
        labels=labels,
        mix=float(mix),
        delay=delay,
        lane=lane,
        slices=slices,
        outer_sync=outer_sync,
        world=_world(fn, islands_, timeout),
    )


def _world(fn, isl: Islands, timeout):
    """The backend over every process of the job that the configuration is
    agreed on, or None: one process, or islands as a mesh axis.

    Made now, on every process (collective over the world): never while tracing."""
    world = isl.world
    if world is None or world.Get_size() < 2:
        return None
    timeout = None if timeout is None else float(timeout)
    return _mpi_backend.MPIBackend(world, timeout=timeout, name=f"{fn} agreement")


def _sliced(fn, isl: Islands, slice_anchor, strategy, comm_dtype, timeout):
    """``slice_anchor=True``: the island's replicas' config and the outer mean's."""
    if not isinstance(slice_anchor, bool):
        raise bad_type(fn, "slice_anchor", "a bool", slice_anchor, "slice_anchor=True")
    if not slice_anchor:
        return None, None
    several = isl.axis_name is not None and isl.kind != "axis"
    if several and isl.outer_comm is not None:
        raise ValueError(
            f"{fn}: slice_anchor=True slices the anchor over the island's replicas, "
            "each averaging its slice with the same slice of the other islands; with "
            f"several devices a process (axis_name={isl.axis_name!r}) and islands across "
            "processes, jaxsync's MPI stage cannot pair devices. Fix: one device per "
            "process (axis_name=None), islands as a mesh axis (jaxsync.AxisComm), or "
            "slice_anchor=False."
        )
    replicas = _config.make_config(fn, "hierarchical", isl.axis_name, isl.comm)
    outer = _config.make_config(
        fn,
        strategy,
        None,
        isl.outer_comm,
        comm_dtype=comm_dtype,
        check_finite=True,
        timeout=timeout,
    )
    return replicas, outer


def strided_labels(tree, fragments: int) -> list[int]:
    """Leaf ``k`` (in ``jax.tree.leaves`` order) goes to fragment ``k % fragments``
    (strided over the layers, as Streaming DiLoCo does)."""
    return [k % fragments for k in range(len(jax.tree.leaves(tree)))]


def leaf_labels(cfg: LocalConfig, tree) -> list[int]:
    """Each leaf's fragment: the user's labels (a pytree of ints like ``tree``) or strided."""
    if cfg.labels is None:
        return strided_labels(tree, cfg.fragments)
    got = jax.tree.leaves(cfg.labels)
    n = len(jax.tree.leaves(tree))
    if len(got) != n or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < cfg.fragments for x in got
    ):
        raise ValueError(
            f"{cfg.fn}: labels must be a pytree like the parameters with one Python "
            f"int in [0, {cfg.fragments}) per leaf ({n} leaves), got {len(got)} "
            f"leaves: {got[:8]}. Fix: e.g. jax.tree.map(lambda _: 0, params)."
        )
    return [int(x) for x in got]
