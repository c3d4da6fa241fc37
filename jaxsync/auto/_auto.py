"""``strategy="auto"``: pick strategy, ``bucket_bytes`` and ``pack_threshold``.

The choice is made at trace time (it needs the tree) from the cost model
(``jaxsync.auto._cost``) and a profile (``python -m jaxsync tune``), deterministically:
the same tree, topology and profile give the same choice. With MPI the profile is
read on every process when the transform is made and rank 0's is broadcast (on
jaxsync's private control communicator), so every process decides alike; the
choice is part of the text the processes compare before their first reduction.
A lossy wire dtype (``comm_dtype`` bfloat16) is chosen only where the user
allows it (``auto_mean(allow_lossy=...)``, :func:`check_allow_lossy`).

May import: optax, the standard library, ``jaxsync.auto._cost``/``_cost_ops`` at the
top; JAX and the rest of jaxsync (``_plan``, ``_config``, ``_sync``, ``_intra``,
``_mpi_backend``, ``_axis_backend``, ``_topology``) inside
functions, as ``_config`` and ``_sync`` import this module.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import optax

from jaxsync._core import _wire
from jaxsync._core._options import AutoKeywords, SyncOptions, merge, takes

from ._choose import (
    AUTO,
    CANDIDATE_BUCKETS,
    CANDIDATE_STRATEGIES,
    CANDIDATE_THRESHOLDS,
    LOSSY_WIRE,
    Choice,
    buckets_of,
    check_allow_lossy,
    choose,
)
from ._cost import Profile
from ._cost_ops import ModelTopology
from ._profiles import (  # noqa: F401 (re-exported: tune, info, bench read profiles here)
    DEFAULT_PROFILE_PATH,
    PROFILE_ENV,
    _warn_no_profile_once,
    default_profile_path,
    load_profile,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from jaxsync._core._config import AxisName, Comm

__all__ = [
    "AUTO",
    "CANDIDATE_BUCKETS",
    "CANDIDATE_STRATEGIES",
    "CANDIDATE_THRESHOLDS",
    "LOSSY_WIRE",
    "AutoSpec",
    "AutoTransformation",
    "Choice",
    "auto_mean",
    "buckets_of",
    "check_allow_lossy",
    "choose",
    "default_profile_path",
    "load_profile",
    "make_auto_config",
    "resolve",
]

log = logging.getLogger("jaxsync")


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """What ``strategy="auto"`` decides from, fixed when the transform is made."""

    profile: Profile
    note: str
    hosts: int = 1
    bucket_bytes: Any = AUTO  # AUTO: chosen; else fixed by the user
    pack_threshold: Any = AUTO
    key: int = 0  # this transform's entry in the record of choices
    lossy: tuple = ()  # lossy wire dtypes allowed (check_allow_lossy)

    def __hash__(self):
        return hash(
            (
                self.profile.digest(),
                self.hosts,
                self.bucket_bytes,
                self.pack_threshold,
                self.key,
                self.lossy,
            )
        )


# --------------------------------------------------------------------------
# Hooks called from _config and _sync
# --------------------------------------------------------------------------

_lock = threading.Lock()
_recent: dict = {}  # AutoSpec.key -> list of Choice (newest last), for describe()
_keys = itertools.count(1)


def make_auto_config(
    fn,
    axis_name,
    comm,
    *,
    profile=None,
    bucket_bytes=AUTO,
    pack_threshold=AUTO,
    allow_lossy=False,
    **options,
):
    """A SyncConfig with ``strategy="auto"`` and an :class:`AutoSpec`.

    Every other option is validated as for :func:`jaxsync.mean`. For an MPI
    communicator the profile of rank 0 is broadcast and the number of hosts found
    now (collective: this runs when the factory is called, on every process).
    """
    from jaxsync._comm import _mpi_backend
    from jaxsync._core._config import make_config

    if not (profile is None or isinstance(profile, (str, os.PathLike, dict, Profile))):
        raise TypeError(
            f"{fn} got unexpected type for argument 'profile' (expected: a path, a "
            f"dict, a jaxsync profile or None, got: {type(profile).__name__} "
            f"{profile!r}). Fix: profile='profile.json' (written by `python -m jaxsync "
            "tune --out profile.json`) or profile=None (the default path, else built-in)."
        )
    lossy = check_allow_lossy(fn, allow_lossy, options.get("comm_dtype"))
    base = make_config(
        fn,
        "hierarchical",
        axis_name,
        comm,
        bucket_bytes=64 * 2**20 if bucket_bytes == AUTO else bucket_bytes,
        pack_threshold=256 * 2**10 if pack_threshold == AUTO else pack_threshold,
        **options,
    )
    prof, note = load_profile(profile)
    is_mpi = isinstance(base.backend, _mpi_backend.MPIBackend)
    if profile is None and not os.environ.get(PROFILE_ENV) and not default_profile_path().exists():
        # Nothing asked for and nothing at the default path. With MPI rank 0's
        # profile is used by every process: rank 0 alone says so.
        if not is_mpi or base.backend.comms.rank == 0:
            _warn_no_profile_once(fn)
    hosts = 1
    if is_mpi:
        from jaxsync._comm._topology import topology

        comms = base.backend.comms
        hosts = topology(base.backend.comm).hosts
        mine = {"profile": prof.to_json(), "source": prof.source, "note": note}
        got = comms.control.bcast(mine, root=0)
        if comms.rank != 0:
            if Profile.from_json(got["profile"]).digest() != prof.digest():
                note = f"rank 0's profile ({got['note']}), which differs from this process's"
            else:
                note = got["note"]
            prof = dataclasses.replace(Profile.from_json(got["profile"], got["source"]))
    spec = AutoSpec(prof, note, hosts, bucket_bytes, pack_threshold, next(_keys), lossy)
    return dataclasses.replace(base, strategy=AUTO, auto=spec)


def resolve(tree, cfg):
    """At trace time: ``cfg`` with the strategy, buckets and threshold chosen."""
    from jax import lax

    from jaxsync._comm import _axis_backend, _host_tier, _intra, _mpi_backend

    spec = cfg.auto
    D = _intra.axes_size(cfg.axes) if cfg.axes else 1
    backend = cfg.backend
    P = backend.size()
    inter_link = None
    if isinstance(backend, _axis_backend.AxisBackend):
        import jax

        inter_link = "device" if jax.process_count() == 1 else "network"
    batched = bool(cfg.axes) and _intra._is_batched(lax.axis_index(cfg.axes))
    topo = ModelTopology(
        processes=P,
        hosts=spec.hosts,
        local_devices=D,
        native=bool(getattr(backend, "native", False)),
        staging=getattr(backend, "staging", "device"),
        broadcast=isinstance(backend, _mpi_backend.MPIBackend) and not batched,
        inter_link=inter_link,
        # where the topology has a tier: the option, after JAXSYNC_HOST_TIER
        # (the model's ``tiers`` applies it to each candidate's wire dtype)
        host_tier=_host_tier.effective(cfg.host_tier)
        if isinstance(backend, _mpi_backend.MPIBackend)
        and not batched
        and backend.tier(True) is not None
        else False,
    )
    import jax.numpy as jnp

    itemsize = jnp.dtype(cfg.comm_dtype).itemsize if cfg.comm_dtype else None
    if cfg.quant is not None or cfg.comm_dtype in _wire.names(lossy=True):
        # a registered lossy wire: its bytes per value (codes and scales if quantized)
        itemsize = _wire.of(cfg.quant or cfg.comm_dtype).bytes_per_value()
    choice = choose(
        tree,
        topo,
        spec.profile,
        bucket_bytes=spec.bucket_bytes,
        pack_threshold=spec.pack_threshold,
        comm_itemsize=itemsize,
        profile_note=spec.note,
        lossy=spec.lossy,
    )
    with _lock:
        got = _recent.setdefault(spec.key, [])
        if not got or got[-1] != choice:
            got.append(choice)
            del got[:-8]
            log.info(choice.describe().splitlines()[0])
            for w in choice.warnings:
                warnings.warn(f"jaxsync auto: {w}", stacklevel=4)
    return dataclasses.replace(
        cfg,
        strategy=choice.strategy,
        bucket_bytes=choice.bucket_bytes,
        pack_threshold=choice.pack_threshold,
        comm_dtype=choice.comm_dtype or cfg.comm_dtype,
    )


# --------------------------------------------------------------------------
# The public factory
# --------------------------------------------------------------------------


class AutoTransformation(optax.GradientTransformation):
    """An optax ``GradientTransformation`` that says what ``auto`` chose.

    ``describe()`` returns the choices made so far (one per traced tree and
    topology), with the predicted time of every strategy.
    """

    __slots__ = ()

    def describe(self) -> str:
        return _describe(self)


class WeightedAutoTransformation(optax.GradientTransformationExtraArgs):
    """:class:`AutoTransformation` made with ``weights=``: ``update`` takes
    ``weight=`` and ``done=`` (an ``optax.chain`` passes them through)."""

    __slots__ = ()

    def describe(self) -> str:
        return _describe(self)


def _describe(tx) -> str:
    """What an auto transformation chose (both classes' ``describe``)."""
    cfg = getattr(tx.update, "config", None)
    if cfg is None:
        return "jaxsync auto: not an auto transformation"
    with _lock:
        got = list(_recent.get(cfg.auto.key, []))
    if not got:
        return (
            f"jaxsync auto: nothing chosen yet (the choice is made when the "
            f"step is first traced, from the tree); {cfg.auto.note}"
        )
    return "\n".join(c.describe() for c in got)


@takes(AutoKeywords)
def auto_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    options: SyncOptions | None = None,
    profile: str | os.PathLike | dict | Profile | None = None,
    allow_lossy: bool | tuple[str, ...] = False,
    **overrides: Unpack[AutoKeywords],
) -> AutoTransformation | WeightedAutoTransformation:
    """Average gradients with the strategy the cost model predicts fastest.

    When the step is first traced, the transform predicts the time of every
    strategy (``hierarchical``, ``two_dimensional``, ``flat``, ``naive``) and of
    a few ``bucket_bytes``/``pack_threshold`` values for this tree and topology
    (processes, hosts, local devices) from a calibrated profile, and uses the
    fastest; ``tx.describe()`` shows the choice and the predictions, and it is
    logged (logger ``"jaxsync"``, level INFO). The same tree, topology and
    profile always give the same choice. With MPI every process uses rank 0's
    profile (broadcast when the factory is called, so call it on every process)
    and the processes compare the choice with the rest of the plan before the
    first reduction. A lossy wire dtype is chosen only where ``allow_lossy``
    allows it, and only when predicted faster than every lossless candidate;
    ``describe()`` says what was allowed and what was picked.

    Args:
      axis_name: as for :func:`jaxsync.mean`.
      comm: as for :func:`jaxsync.mean`.
      profile: a profile written by ``python -m jaxsync tune --out FILE`` (a
        path), its JSON as a dict, or ``None``: ``$JAXSYNC_PROFILE``, else
        ``~/.cache/jaxsync/profile.json`` (where ``tune`` writes by default),
        else the built-in default parameters (see docs/choosing.md), with a
        ``UserWarning`` once per process (on rank 0 with MPI) naming the fix.
      options, **overrides: as for :func:`jaxsync.mean` (the
        options this one takes: ``help()``); ``bucket_bytes`` and
        ``pack_threshold`` are chosen where ``"auto"`` (the default).
      allow_lossy: ``False`` (default: lossless only), ``True`` (bfloat16 on
        the wire may be chosen) or a tuple of wire dtypes from
        ``("bfloat16", "float16")``. ``powersgd_mean`` and ``sign_mean`` are
        not candidates (their state is of another kind, made by ``init``
        before the choice at trace time): naming them is an error. Not with ``comm_dtype``.

    Returns:
      an optax ``GradientTransformation`` with a ``describe()`` method (with
      ``weights=``, a ``GradientTransformationExtraArgs``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.auto_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
      >>> print(tx.describe().splitlines()[0])  # doctest: +ELLIPSIS
      jaxsync auto: ... predicted ... 1 process(es) on 1 host(s) x 4 device(s)...
    """
    from jaxsync._core._sync import transform_fns

    fn = "auto_mean"
    kw = merge(fn, options, overrides, takes=auto_mean.takes)  # type: ignore[attr-defined]
    weights = kw.pop("weights")
    cfg = make_auto_config(fn, axis_name, comm, profile=profile, allow_lossy=allow_lossy, **kw)
    if weights is not False:  # per-replica weights and the join, as the named strategies
        from jaxsync._core import _join

        tx = _join.transform(fn, cfg, weights, lambda c: transform_fns(fn, c))
        tx.update.config = cfg
        return WeightedAutoTransformation(tx.init, tx.update)
    init_fn, update_fn = transform_fns(fn, cfg)
    update_fn.config = cfg
    return AutoTransformation(init_fn, update_fn)
