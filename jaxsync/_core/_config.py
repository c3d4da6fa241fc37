"""Static configuration of one synchronisation: validated when a factory is called.

``make_config`` checks every option of ``sync_gradients`` and the factories
(errors name the argument, what was expected, what was given and the fix) and
builds the backend; ``SyncConfig`` is the frozen result that ``_sync`` follows.
``check_count`` and ``check_transformation`` are the argument checks of the
factories that wrap an optimizer (``accumulate``, ``apply_if_finite``, ``sharded``).
Imports: ``_plan``, ``_topology``, the backends and ``_plugins`` (``sparse=`` and
``strategy="auto"`` are checked by their areas);
nothing here traces.
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Final, Literal, Union

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxsync._comm import _axis_backend, _host_tier, _mpi_backend
from jaxsync._comm._topology import default_comm

from . import _plugins, _strategies
from ._overlap import OVERLAP_BUCKET_BYTES, check_overlap, resolve_overlap, warn_no_inter_stage
from ._overlap import bad_type as _bad_type
from ._plan import DEFAULT_BUCKET_BYTES, DEFAULT_PACK_THRESHOLD, REDUCED_DTYPES, _check_bytes
from ._quant import Quantized

# flat packs every leaf: its default buckets stay below glibc's largest mmap
# threshold (32 MiB on 64-bit), so a packed temporary is never an mmap/munmap
# pair with fresh page faults on every step.
FLAT_BUCKET_BYTES = 4 * 2**20

AUTO: Final = "auto"


if TYPE_CHECKING:
    from mpi4py import MPI

#: The replicas' mesh axis name(s) in this process; ``None``: no mapped axis.
AxisName = str | tuple[str, ...] | None
#: The inter-process stage: an mpi4py ``Intracomm``, a :class:`jaxsync.AxisComm`,
#: ``None`` (one process) or ``"auto"``.
Comm = Union["MPI.Intracomm", "_axis_backend.AxisComm", None, str]  # noqa: UP007 (quoted)
#: ``"mean"`` or ``"sum"``.
Reduce = Literal["mean", "sum"]
#: A byte count, ``None`` (no cap / pack everything) or ``"auto"`` (the default).
Bytes = int | None | Literal["auto"]
#: ``False``, ``True`` (a flag in the state) or ``"raise"``.
CheckFinite = bool | Literal["raise"]
#: ``"device"`` or ``"host"`` (MPI through host memory).
Staging = Literal["device", "host"]
#: What the stall watchdog does after ``timeout``: ``"report"`` or ``"abort"``.
OnTimeout = Literal["report", "abort"]
#: ``True``, ``False`` or ``"auto"`` (the host tier for 16-bit wires only).
HostTier = bool | Literal["auto"]
#: ``strategy="auto"``'s profile: a path, its JSON as a dict, a profile, or None.
ProfileLike = Any
__all__ = [
    "AUTO",
    "AxisName",
    "Bytes",
    "CheckFinite",
    "Comm",
    "DTypeLike",
    "HostTier",
    "OnTimeout",
    "ProfileLike",
    "Reduce",
    "Staging",
    "SyncConfig",
    "check_options",
    "make_config",
]
_REDUCES = ("mean", "sum")
_STAGINGS = ("device", "host")
_CHECKS = (False, True, "raise")
_ON_TIMEOUTS = ("report", "abort")


def _normalize_axes(fn: str, axis_name) -> tuple:
    if axis_name is None:
        return ()
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, tuple) and all(isinstance(a, str) for a in axis_name):
        if len(set(axis_name)) != len(axis_name):
            raise ValueError(
                f"{fn}: axis_name {axis_name!r} repeats an axis. Fix: name "
                f"each axis once, e.g. {tuple(dict.fromkeys(axis_name))!r}."
            )
        return axis_name
    if isinstance(axis_name, list):
        raise _bad_type(
            fn,
            "axis_name",
            "a str or a tuple of str",
            axis_name,
            f"pass a tuple: axis_name={tuple(axis_name)!r}",
        )
    raise _bad_type(
        fn,
        "axis_name",
        "a str, a tuple of str, or None",
        axis_name,
        "pass the axis name(s) bound by shard_map/pmap/vmap, e.g. axis_name='data'",
    )


def _make_backend(fn: str, comm, staging: str, timeout=None, on_timeout="report"):
    if isinstance(comm, str) and comm == AUTO:
        comm = default_comm()
    if comm is None:
        return _axis_backend.LocalBackend()
    if isinstance(comm, _axis_backend.AxisComm):
        return _axis_backend.AxisBackend(comm)
    _check_comm_type(fn, comm)
    if comm.Get_size() == 1:
        return _axis_backend.LocalBackend()
    return _mpi_backend.MPIBackend(
        comm,
        staging=staging,
        timeout=None if timeout is None else float(timeout),
        on_timeout=on_timeout,
        name=fn,
    )


def _check_comm_type(fn: str, comm) -> None:
    """TypeError unless ``comm`` is None, 'auto', an AxisComm or an Intracomm."""
    if (
        comm is None
        or isinstance(comm, _axis_backend.AxisComm)
        or (isinstance(comm, str) and comm == AUTO)
    ):
        return
    # An mpi4py communicator exists only once mpi4py.MPI is imported: never import
    # it (which initialises MPI) just to reject a wrong argument.
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and isinstance(comm, MPI.Intracomm):
        return
    raise _bad_type(
        fn,
        "comm",
        "an mpi4py Intracomm, jaxsync.AxisComm, None or 'auto'",
        comm,
        "pass comm=MPI.COMM_WORLD, comm=jaxsync.AxisComm('host') or comm=None",
    )


def _check_dtype(fn, comm_dtype):
    if comm_dtype is None or isinstance(comm_dtype, Quantized):
        return None
    try:
        dt = str(jnp.dtype(comm_dtype))
    except TypeError:
        raise _bad_type(
            fn,
            "comm_dtype",
            f"one of {REDUCED_DTYPES} or None",
            comm_dtype,
            "pass e.g. comm_dtype=jnp.bfloat16",
        ) from None
    if dt not in REDUCED_DTYPES:
        raise ValueError(
            f"{fn}: comm_dtype must be one of {REDUCED_DTYPES}, a jaxsync.Quantized or "
            f"None, got {dt}. Fix: pass e.g. comm_dtype=jnp.bfloat16, or "
            "comm_dtype=jaxsync.Quantized(bits=8) for 8 bits (4 with bits=4)."
        )
    return dt


# jaxsync.accumulate's k while it traces its wrapped update: in the agreed text
# (ranks with another k reach the sync at other calls: named, not only counted)
ACCUMULATE: contextvars.ContextVar[int] = contextvars.ContextVar("jaxsync_acc", default=1)


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Validated static configuration of one synchronisation."""

    strategy: str
    axes: tuple
    backend: Any
    reduce: str = "mean"
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    pack_threshold: int | None = DEFAULT_PACK_THRESHOLD
    comm_dtype: str | None = None
    predivide: float | None = None
    check_finite: Any = False
    sparse: Any = None  # _sparse.SparseOptions: how RowSparse leaves travel
    auto: Any = None  # strategy="auto": what it decides from (_auto.AutoSpec)
    overlap: bool = False  # one async call per bucket, in backward's order ("auto" resolved)
    overlap_bucket_bytes: int = OVERLAP_BUCKET_BYTES
    double_buffering: bool = False  # apply step t-1's mean at step t
    host_tier: Any = AUTO  # True, False or "auto" (_host_tier.chosen)
    quant: Any = None  # comm_dtype=Quantized(...): the wire format (_quantsum)
    # weights=: (weights, reduce, predivide[, early_termination]) as the user gave
    # them (_join sums with reduce="sum"); the agreed text shows these, so a rank
    # without weights is told that weights differs, not reduce
    weights: Any = None

    def describe(self, accumulate: int = 1) -> str:
        """The agreed text (``accumulate``: sharded's k; else ACCUMULATE's)."""
        forced = _host_tier.override()
        accumulate = max(accumulate, ACCUMULATE.get())
        weights, reduce, predivide, *early = self.weights or (None, self.reduce, self.predivide)
        # one word per value (_agree names the option that differs)
        wire = self.comm_dtype if self.quant is None else repr(self.quant).replace(" ", "")
        return (
            f"strategy {self.strategy} reduce {reduce} comm_dtype "
            f"{wire} predivide {predivide} check_finite "
            f"{self.check_finite!r} backend {self.backend.name} staging "
            f"{getattr(self.backend, 'staging', None)} timeout "
            f"{getattr(self.backend, 'timeout', None)}"
            + (
                f" on_timeout {self.backend.on_timeout}"
                if getattr(self.backend, "timeout", None) is not None
                else ""
            )
            + (f" auto profile {self.auto.profile.digest()}" if self.auto else "")
            + (f" overlap {self.overlap_bucket_bytes}" if self.overlap else "")
            + (" double_buffering" if self.double_buffering else "")
            # the path every synchronisation takes across hosts (its option)
            + f" host_tier {self.host_tier}"
            + (f" weights {weights}" if weights is not None else "")
            + ("" if early in ([], ["join"]) else f" early_termination {early[0]}")
            + (f" accumulate {accumulate}" if accumulate > 1 else "")
            + ("" if forced is None else f" {_host_tier.HOST_TIER_ENV}={int(forced)}")
        )


def check_count(fn: str, name: str, value, meaning: str, example: str) -> None:
    """``value`` (the argument ``name``: ``meaning``) is an int >= 1, else a
    ValueError that names it and the fix (``example``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{fn}: {name} must be an int >= 1 ({meaning}), got {value!r}. Fix: e.g. {example}."
        )


def check_transformation(fn: str, name: str, tx, example: str) -> None:
    """``tx`` (the wrapped optimizer, the argument ``name``) has optax's ``init``
    and ``update``, else a TypeError that names it and the fix (``example``)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{fn}: {name} must be an optax GradientTransformation (with init and "
            f"update), got {type(tx).__name__}. Fix: e.g. {example}."
        )


def check_options(
    fn,
    *,
    reduce,
    bucket_bytes,
    pack_threshold,
    comm_dtype,
    predivide,
    check_finite,
    staging,
    timeout,
    on_timeout,
    sparse,
    overlap,
    overlap_bucket_bytes,
    double_buffering,
    host_tier,
) -> dict:
    """Check the shared options (the text of each is ``_options.SyncOptions``'):
    TypeError/ValueError naming the option. Returns the normalised wire dtype
    (``comm_dtype``), ``sparse`` and ``overlap_bucket_bytes``."""
    if not isinstance(reduce, str) or reduce not in _REDUCES:
        raise ValueError(
            f"{fn}: reduce must be one of {_REDUCES}, got {reduce!r}. "
            "Fix: reduce='mean' (default) or reduce='sum'."
        )
    for name, value in (("bucket_bytes", bucket_bytes), ("pack_threshold", pack_threshold)):
        if not (isinstance(value, str) and value == AUTO):
            _check_bytes(name, value, allow_none=True)
    dt = _check_dtype(fn, comm_dtype)
    if predivide is not None and (
        isinstance(predivide, bool) or not isinstance(predivide, (int, float))
    ):
        raise _bad_type(
            fn,
            "predivide",
            "a Python float >= 1 or None",
            predivide,
            "pass e.g. predivide=8.0 (a traced value cannot be static)",
        )
    if predivide is not None and (not predivide >= 1.0 or not np.isfinite(predivide)):
        raise ValueError(
            f"{fn}: predivide must be a finite float >= 1, got "
            f"{predivide}. Fix: predivide=1.0 (off) or the replica count."
        )
    if not (isinstance(check_finite, bool) or check_finite == "raise"):
        raise ValueError(
            f"{fn}: check_finite must be one of {_CHECKS}, got "
            f"{check_finite!r}. Fix: check_finite=True (a flag in the "
            "state) or check_finite='raise' (an error naming the leaves)."
        )
    if staging not in _STAGINGS:
        raise ValueError(
            f"{fn}: staging must be one of {_STAGINGS}, got {staging!r}. "
            "Fix: staging='device' (default) or staging='host'."
        )
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise _bad_type(
                fn,
                "timeout",
                "a number of seconds or None",
                timeout,
                "pass e.g. timeout=60.0, or None to turn the watchdog off",
            )
        if not timeout > 0:
            raise ValueError(
                f"{fn}: timeout must be > 0 seconds, got {timeout}. "
                "Fix: timeout=60.0, or None (off)."
            )
    if not isinstance(on_timeout, str):
        raise _bad_type(
            fn,
            "on_timeout",
            f"one of {_ON_TIMEOUTS}",
            on_timeout,
            "pass on_timeout='report' (default: print and keep waiting) or "
            "on_timeout='abort' (print and end the job)",
        )
    if on_timeout not in _ON_TIMEOUTS:
        raise ValueError(
            f"{fn}: on_timeout must be one of {_ON_TIMEOUTS}, got {on_timeout!r}. "
            "Fix: on_timeout='report' (default: print which ranks have not arrived "
            "and keep waiting) or on_timeout='abort' (print it and end the job)."
        )
    if on_timeout == "abort" and timeout is None:
        raise ValueError(
            f"{fn}: on_timeout='abort' needs a timeout, got timeout=None (the "
            "watchdog is off). Fix: pass the seconds a process may wait in one "
            "inter-process stage, e.g. timeout=300.0, on_timeout='abort'."
        )
    sparse = _plugins.check_option("sparse", fn, sparse)
    overlap_bucket_bytes = check_overlap(fn, overlap, overlap_bucket_bytes, double_buffering)
    _host_tier.check(fn, host_tier)
    return {"comm_dtype": dt, "sparse": sparse, "overlap_bucket_bytes": overlap_bucket_bytes}


_NOT_OPTIONS = ("fn", "strategy", "axis_name", "comm", "profile")


def make_config(
    fn,
    strategy,
    axis_name,
    comm,
    *,
    reduce="mean",
    bucket_bytes=AUTO,
    pack_threshold=AUTO,
    comm_dtype=None,
    predivide=None,
    check_finite=False,
    staging="device",
    timeout=None,
    on_timeout="report",
    sparse=None,
    profile=None,
    overlap=AUTO,
    overlap_bucket_bytes=AUTO,
    double_buffering=False,
    host_tier=AUTO,
) -> SyncConfig:
    """Validate every static option; raise TypeError/ValueError naming it."""
    # every option but the strategy's own, as given (checked below or by "auto")
    opts = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
    chosen = _plugins.strategy(strategy) if isinstance(strategy, str) else None
    quant = comm_dtype if isinstance(comm_dtype, Quantized) else None
    if chosen is not None:  # "auto": chosen at trace time (jaxsync.auto, _sync.sync)
        return chosen.make_config(fn, axis_name, comm, profile=profile, **opts)
    if profile is not None:
        raise ValueError(
            f"{fn}: profile is used by strategy='auto' only, got strategy="
            f"{strategy!r}. Fix: strategy='auto', or drop profile."
        )
    if strategy not in _strategies.STRATEGIES:
        raise ValueError(
            f"{fn}: strategy must be one of {_strategies.STRATEGIES} or 'auto', got {strategy!r}."
        )
    axes = _normalize_axes(fn, axis_name)
    checked = check_options(fn, **opts)
    dt, sparse = checked["comm_dtype"], checked["sparse"]
    overlap_bucket_bytes = checked["overlap_bucket_bytes"]
    if isinstance(bucket_bytes, str) and bucket_bytes == AUTO:
        bucket_bytes = FLAT_BUCKET_BYTES if strategy == "flat" else DEFAULT_BUCKET_BYTES
    if isinstance(pack_threshold, str) and pack_threshold == AUTO:
        pack_threshold = None if strategy == "flat" else DEFAULT_PACK_THRESHOLD
    if strategy == "single_node":
        # No inter-process stage: a communicator would be silently ignored.
        _check_comm_type(fn, comm)
        if not (comm is None or (isinstance(comm, str) and comm == AUTO)):
            raise ValueError(
                f"{fn}: strategy 'single_node' reduces over the local axes only and "
                f"ignores comm, got comm={comm!r}. Fix: drop comm (or pass comm=None), "
                "or use strategy='hierarchical' to reduce across processes."
            )
        backend = _axis_backend.LocalBackend()
    else:
        backend = _make_backend(fn, comm, staging, timeout, on_timeout)
    overlap = resolve_overlap(overlap, backend)  # "auto": where it spans hosts
    if (overlap or double_buffering) and isinstance(backend, _axis_backend.LocalBackend):
        warn_no_inter_stage(fn, comm, overlap, double_buffering)
    return SyncConfig(
        strategy,
        axes,
        backend,
        reduce,
        bucket_bytes,
        pack_threshold,
        dt,
        None if predivide is None else float(predivide),
        check_finite,
        sparse=sparse,
        overlap=overlap,
        overlap_bucket_bytes=overlap_bucket_bytes,
        double_buffering=double_buffering,
        host_tier=host_tier,
        quant=quant,
    )
