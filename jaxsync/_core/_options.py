r"""The options every strategy shares: ``SyncOptions``, their one text and check.

Each option is documented once, on ``SyncOptions`` below. A factory takes
``options=`` and the options as keywords (``**options_as_keywords``, typed by one
of the ``TypedDict``\ s below for type checkers; ``takes`` gives the factory the
same keywords as an explicit signature for ``help`` and ``inspect``), and
``merge`` puts the two together: a keyword given overrides ``options``; an option
the factory does not take is refused, by keyword or in ``options``. Validation
is ``_config.check_options``, the check ``make_config`` runs too.

Imports: ``_config`` only (``_join`` imports the checks of ``weights`` and
``early_termination`` from here).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar

from ._config import AUTO, Bytes, CheckFinite, DTypeLike, HostTier, OnTimeout, Reduce, Staging
from ._config import check_options as _check

if TYPE_CHECKING:  # annotations only: the core does not import jaxsync.sparse
    from jaxsync.sparse._rows import SparseOptions


#: ``False`` (no weights), ``True`` (divide by the total weight) or ``"world"``
#: (divide by the replica count).
Weights = bool | Literal["world"]
_WEIGHTS = (False, True, "world")
#: What a step does where some replicas are done and others are not:
#: ``"join"`` (the done ones contribute zeros at weight 0) or ``"raise"``.
EarlyTermination = Literal["join", "raise"]
_EARLY = ("join", "raise")


def check_weights(fn: str, weights, reduce: str) -> None:
    """Validate ``weights=`` when a factory is called."""
    if not any(weights is w or (isinstance(weights, str) and weights == w) for w in _WEIGHTS):
        raise ValueError(
            f"{fn}: weights must be one of (False, True, 'world'), got {weights!r}. Fix: "
            "weights=True (the mean divides by the sum of the weights) or weights='world' "
            "(by the replica count, DDP's division by the initial world size)."
        )
    if weights == "world" and reduce != "mean":
        raise ValueError(
            f"{fn}: weights='world' divides the weighted sum by the replica count, "
            f"but reduce={reduce!r}. Fix: reduce='mean', or weights=True (with "
            "reduce='sum' the result is the weighted sum)."
        )


def check_early_termination(fn: str, early_termination, weights) -> None:
    """Validate ``early_termination=`` when a factory is called."""
    if not (isinstance(early_termination, str) and early_termination in _EARLY):
        raise ValueError(
            f"{fn}: early_termination must be 'join' or 'raise', got {early_termination!r}. "
            "Fix: early_termination='join' (replicas out of data join with zeros at "
            "weight 0) or 'raise' (every replica raises once one is out of data)."
        )
    if early_termination == "raise" and weights is False:
        raise ValueError(
            f"{fn}: early_termination='raise' reads the replicas' done= flags, which "
            "only a transform made with weights= takes, but weights=False. Fix: "
            "weights=True (or 'world') and pass done= to update."
        )


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """The options of a gradient synchronisation, shared by every strategy.

    Give them to a factory as ``options=`` (one object for several transforms,
    or a configuration file's), or as keywords of the same names: every
    factory of :func:`jaxsync.mean`'s family takes both, and a
    keyword overrides ``options``. An option the factory does not take is
    refused, as a keyword (``TypeError``) or set in ``options`` (``ValueError``;
    e.g. ``staging`` for :func:`jaxsync.single_node_mean`, which has no
    inter-process stage). Values are checked when the object is made, as a
    factory checks its keywords.

    Attributes:
      reduce: ``"mean"`` (divide by devices x processes) or ``"sum"``.
      bucket_bytes: cap on one packed buffer (``None``: no cap; ``"auto"``:
        64 MiB; ``flat``: 4 MiB, because on CPU larger packed buffers cost more
        in copies and fresh pages than they save in messages - with 8 devices
        of one process 16 MiB buckets took 4x longer on a ResNet-18-sized tree;
        a leaf larger than the cap travels alone, without a copy;
        :func:`jaxsync.auto_mean`: chosen).
      pack_threshold: leaves of at least this many bytes travel in their own
        buffer without a copy (``None``: pack everything; ``"auto"``: 256 KiB;
        ``flat``: ``None``; :func:`jaxsync.auto_mean`: chosen).
      comm_dtype: dtype on the wire (``None``: each buffer's own dtype; or
        ``jnp.bfloat16``/``jnp.float16``, lossy, or a :class:`jaxsync.Quantized`:
        8/4 bits). Always summed in float32 (16-bit: rounded once).
      predivide: divide by this before the sum and by ``n / predivide`` after
        (Horovod's ``gradient_predivide_factor``). ``None``: with
        ``reduce="mean"``, the replica count ``n`` if a power of two (exact,
        fused into packing); float16: the largest power of two <= ``n`` (exact;
        overflows only near float16's limit); else 1 (divided at unpacking).
      check_finite: ``True`` keeps ``all_finite`` in the state
        (:class:`jaxsync.SyncState`); ``"raise"`` also raises
        ``FloatingPointError`` naming the non-finite leaves.
      staging: ``"device"``, or ``"host"`` (MPI through host memory, for an MPI
        without GPU support).
      timeout: seconds (MPI only; ``None``: off): when this process has waited
        longer than this in one inter-process stage (the first execution's
        agreement included), a watchdog thread prints which ranks have not
        arrived, which synchronisation and which step.
      on_timeout: what the watchdog does then: ``"report"`` (default) keeps
        waiting (the result is unchanged when the straggler arrives);
        ``"abort"`` makes every process that can still answer print the same
        diagnosis once and ends the job with ``MPI_Abort`` (a non-zero exit),
        also when a peer is dead or unreachable. Needs ``timeout``.
      sparse: how :class:`jaxsync.RowSparse` leaves are synchronised (a
        :class:`jaxsync.SparseOptions`; ``None``: automatic).
      overlap: ``True`` sends the gradients in buckets, in the order backward
        produces them (the tree's leaves last to first), each bucket as soon as
        it exists; with MPI on CPU the sums run on a communication thread while
        the step computes on (see "Overlap" in docs/strategies.md). The same bits
        as ``False``. The buckets' order assumes the tree lists the model's
        layers first to last. ``"auto"`` (default): on where the inter-process
        stage spans more than one host (MPI, the topology's host count) on
        jaxsync's native CPU target, off within one host, without MPI, and where
        MPI blocks (mpi4jax on GPU, ``staging="host"``). ``True`` without an
        inter-process stage (one process) hides nothing, and the factory warns.
      overlap_bucket_bytes: with ``overlap``, about this many bytes per bucket
        (``"auto"``: 4 MiB; the first bucket 1 MiB).
      double_buffering: ``True`` applies, at step ``t``, the mean of the
        gradients of step ``t - 1`` (ChainerMN's ``double_buffering``): step
        ``t``'s local gradients are kept in the state
        (:class:`jaxsync.DoubleBufferState`), and their reduction runs during
        step ``t + 1``'s forward and backward. The first step applies zeros (the
        state starts from zero gradients; ChainerMN skips its first update):
        plain SGD leaves the parameters unchanged, an optimizer after this
        transform sees one zero gradient. The gradients of the last step are in
        the state and never applied. A checkpoint of the state taken between
        steps resumes the same run bit for bit. The step of staleness costs
        accuracy on a short run (see docs/strategies.md); without an
        inter-process stage (one process) there is nothing to hide and the
        factory warns.
      host_tier: the host tier (MPI on CPU, several hosts, several processes on
        a host): a host's processes reduced first, then one process per host
        (or each local rank's slice) across hosts, then the host's result
        (see "The host tier" in docs/strategies.md). ``"auto"`` (default):
        for a synchronisation most of whose bytes are 16-bit on the wire
        (``comm_dtype=jnp.bfloat16``, bfloat16 parameters), where it always
        sends fewer bytes across hosts; float32 keeps MPI's own allreduce.
        ``True``: whenever the topology has one; ``False``: never.
        ``JAXSYNC_HOST_TIER=1`` / ``0`` overrides it for every transform.
      weights: ``True``: ``update`` takes ``weight=`` (a scalar per replica; 1 by
        default) and ``done=`` (no data after this step) and returns
        ``sum(w g) / sum(w)`` (0 if all are 0); ``"world"``: ``sum(w g) / n``
        (the state: :class:`jaxsync.WeightedState` around the transform's own).
        See :func:`jaxsync.all_done`, docs/strategies.md. The compressors
        (``powersgd_mean``, ``sign_mean``) sum the weights first, in one more
        small synchronisation, and scale each replica's gradients by
        ``w n / sum(w)`` before compressing; a step where every weight is 0
        returns zeros and leaves the residuals as they were.
      early_termination: ``"join"`` (default): replicas out of data join (zeros
        at weight 0) until every replica is done; ``"raise"`` (with
        ``weights=``; Horovod's ``throw_on_early_termination``): a step where
        some but not all replicas pass ``done=True`` raises ``RuntimeError`` on
        every replica.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> opts = jaxsync.SyncOptions(reduce="sum", bucket_bytes=2**20)
      >>> tx = jaxsync.flat_mean(axis_name="i", comm=None, options=opts)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([6., 6., 6., 6.], dtype=float32)
      >>> opts.replace(reduce="mean").reduce
      'mean'
    """

    reduce: Reduce = "mean"
    bucket_bytes: Bytes = AUTO
    pack_threshold: Bytes = AUTO
    comm_dtype: DTypeLike | None = None
    predivide: float | None = None
    check_finite: CheckFinite = False
    staging: Staging = "device"
    timeout: float | None = None
    on_timeout: OnTimeout = "report"
    sparse: SparseOptions | None = None
    overlap: bool | Literal["auto"] = AUTO
    overlap_bucket_bytes: Bytes = AUTO
    double_buffering: bool = False
    host_tier: HostTier = AUTO
    weights: Weights = False
    early_termination: EarlyTermination = "join"

    def __post_init__(self):
        check("jaxsync.SyncOptions", {name: getattr(self, name) for name in FIELDS})

    def replace(self, **changes: Any) -> SyncOptions:
        """A copy with ``changes`` (checked as the constructor checks)."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(
                f"SyncOptions.replace: no option {unknown[0]!r}. Expected one of "
                f"{FIELDS}. Fix: check the spelling."
            )
        return dataclasses.replace(self, **changes)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SyncOptions))
DEFAULTS: Mapping[str, Any] = {f.name: f.default for f in dataclasses.fields(SyncOptions)}


def check(fn: str, values: Mapping[str, Any]) -> None:
    """Validate options (any subset of ``FIELDS``) as a factory called ``fn`` would."""
    core = {k: values.get(k, DEFAULTS[k]) for k in FIELDS[:14]}
    _check(fn, **core)
    weights = values.get("weights", False)
    check_weights(fn, weights, core["reduce"])
    check_early_termination(fn, values.get("early_termination", "join"), weights)


def _same(a, b) -> bool:
    # True == 1 and jnp dtypes compare loosely: the same type and value, or the same object
    return a is b or (type(a) is type(b) and a == b)


def merge(fn: str, options: SyncOptions | None, given: Mapping[str, Any], takes: Iterable[str]):
    """The options a factory called ``fn`` (taking the options ``takes``) runs
    with: ``options`` (or the defaults), then the keywords ``given`` over them; a
    dict keyed by ``takes``. Raises naming the option where a keyword or a
    non-default field of ``options`` is one the factory does not take."""
    takes = tuple(takes)
    unknown = [k for k in given if k not in takes]
    if unknown:
        near = [k for k in unknown if k in FIELDS]
        why = (
            f"it takes no option {near[0]!r} (it takes {', '.join(takes)})"
            if near
            else f"it takes {', '.join(takes)}; the options are those of jaxsync.SyncOptions"
        )
        raise TypeError(f"{fn}() got an unexpected keyword argument {unknown[0]!r}: {why}.")
    if options is not None and not isinstance(options, SyncOptions):
        raise TypeError(
            f"{fn} got unexpected type for argument 'options'; expected: a "
            f"jaxsync.SyncOptions or None; given: {type(options).__name__} "
            f"{options!r}. Fix: options=jaxsync.SyncOptions(reduce='sum', ...), "
            "or pass the options as keywords."
        )
    out = {name: DEFAULTS[name] for name in takes}
    for name in FIELDS if options is not None else ():
        value = getattr(options, name)
        if name in takes:
            out[name] = value
        elif not _same(value, DEFAULTS[name]):
            raise ValueError(
                f"{fn} takes no option {name!r}, but options.{name}={value!r}. Fix: "
                f"options.replace({name}={DEFAULTS[name]!r}) for this factory."
            )
    out.update(given)
    return out


# The options each factory takes, as keywords: typed for type checkers
# (``**options_as_keywords: Unpack[...]``), and made its signature by ``takes``.
class _Wire(TypedDict, total=False):
    reduce: Reduce
    comm_dtype: DTypeLike | None
    predivide: float | None
    check_finite: CheckFinite


class _Packing(TypedDict, total=False):
    bucket_bytes: Bytes
    pack_threshold: Bytes
    sparse: SparseOptions | None


class _Stage(TypedDict, total=False):
    staging: Staging
    timeout: float | None
    on_timeout: OnTimeout


class _Overlap(TypedDict, total=False):
    overlap: bool | Literal["auto"]
    overlap_bucket_bytes: Bytes
    double_buffering: bool


class _Weights(TypedDict, total=False):
    weights: Weights


class _Join(_Weights, total=False):
    early_termination: EarlyTermination


class _Tier(TypedDict, total=False):
    host_tier: HostTier


class SingleNodeKeywords(_Wire, _Packing, _Join, total=False):
    """``single_node_mean``'s options: no inter-process stage."""


class SyncKeywords(_Wire, _Packing, _Stage, total=False):
    """``sync_gradients``' options: a function, no state."""


class NaiveKeywords(_Wire, _Packing, _Stage, _Overlap, _Join, total=False):
    """``naive_mean``'s options (no host tier: a leaf at a time)."""


class MeanKeywords(NaiveKeywords, _Tier, total=False):
    """The options of ``flat_mean``, ``hierarchical_mean``, ``two_dimensional_mean``."""


class AutoKeywords(_Wire, _Packing, _Stage, _Overlap, _Tier, _Weights, total=False):
    """``auto_mean``'s options (weights without ``early_termination``)."""


class CompressKeywords(_Stage, _Weights, total=False):
    """The compressors' options (``powersgd_mean``, ``sign_mean``): their wire is theirs."""


class ShardedKeywords(_Wire, _Stage, _Join, total=False):
    """``sharded``'s options (its layout is its own: no buckets, no sparse)."""


F = TypeVar("F", bound=Callable[..., Any])
_ANNOTATIONS = {f.name: f.type for f in dataclasses.fields(SyncOptions)}


def names_of(keywords: type) -> tuple[str, ...]:
    """The options of ``keywords`` (a TypedDict above), in ``SyncOptions``' order."""
    names = tuple(n for n in FIELDS if n in keywords.__annotations__)
    assert set(names) == set(keywords.__annotations__), keywords
    return names


def takes(keywords: type) -> Callable[[F], F]:
    """Give a factory ``def f(..., *, options=None, **options_as_keywords)`` the
    options of ``keywords`` (a TypedDict above) as keyword-only parameters of its
    signature, in ``SyncOptions``' order, with their defaults (``help``,
    ``inspect.signature``); ``f.takes`` lists them for ``merge``."""
    names = names_of(keywords)

    def decorate(factory: F) -> F:
        sig = inspect.signature(factory)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        params += [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[n],
                              annotation=_ANNOTATIONS[n])
            for n in names
        ]  # fmt: skip
        factory.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        factory.takes = names  # type: ignore[attr-defined]
        return factory

    return decorate
