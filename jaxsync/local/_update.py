"""One step of a local-update method: the inner step, then, when a fragment's
turn comes, its outer step (pseudo-gradient, mean over islands, outer update,
parameters reset to the new anchor).

Every island runs the same step count, so every island takes the same branch:
the outer mean sits in a ``lax.cond`` on that count, with the native MPI token
chain threaded through it (``compress._phase._select_phase``), and an island
never issues a collective the others do not. Under ``vmap`` (a batched count)
both branches run and the result is selected: the outer mean then travels every
step.

May import: ``_core`` (``_sync.sync``, ``_config``), ``_comm`` (``_invariance``,
``_intra``), ``compress._phase`` (the cond with the token chain), ``_state``,
``_islands``; JAX, optax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxsync._comm import _invariance, _mpi_backend
from jaxsync._core._sync import sync
from jaxsync.compress._phase import _select_phase

from . import _digest
from ._islands import guard
from ._state import LocalConfig, LocalUpdatesState, leaf_labels

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _as_varying(leaves, axes):
    """Every leaf typed varying over ``axes`` (under shard_map), so that values
    equal on every replica of an island are each counted by the mean (not read
    as gradients autodiff already summed, see ``share_invariant``)."""
    if not axes or not set(_invariance._vma(lax.axis_index(axes))):
        return leaves
    return [_invariance._varying(x, axes) for x in leaves]


def _slicing(cfg: LocalConfig, tree, strict: bool = True):
    """``slice_anchor=True``: the anchor's layout over the island's replicas and
    this replica's place (``jaxsync.sharded``'s), else None."""
    if cfg.slices is None:
        return None
    from jaxsync.zero import _layout, _sharded

    place = _sharded.Place(cfg.slices, strict)
    return _layout.make_layout(tree, place.devices, place.processes, cfg.fn), place


def _gather(cfg: LocalConfig, sl, ks, slices) -> list:
    """The whole leaves ``ks`` of the anchor from the island's replicas' slices."""
    from jaxsync.zero import _layout, _sharded

    layout, place = sl
    sub = _layout.Layout(tuple(layout.slots[k] for k in ks), None, layout.devices, layout.processes)
    backend = cfg.slices.backend
    if place.alone:  # one device per process: each leaf's slice as it is
        rows = _sharded.gather_leaves(place.intra, backend, [x.reshape(-1) for x in slices], None)
        return sub.unleaf_rows(rows)
    return sub.unpack_rows(_sharded.gather(place.intra, backend, sub.join(slices)))


def _flags(leaves, value):
    """A flag per fragment, typed varying as the union of ``leaves``' types."""
    vma = tuple(sorted({a for x in leaves for a in _invariance._vma(x)}, key=str))
    return _invariance._varying(value, vma)


def _held(hold, old, new):
    """``old`` where ``hold``, else ``new``; a value typed invariant over an axis
    that ``hold`` varies over (Adam's count, say: the same on every island) keeps
    ``new``, so the state keeps its type (a scan's carry)."""
    if not set(_invariance._vma(hold)) <= set(_invariance._vma(new)):
        return new
    return jnp.where(hold, old, new)


def _fragments(cfg: LocalConfig, tree) -> list[list[int]]:
    labels = leaf_labels(cfg, tree)
    return [[k for k, lab in enumerate(labels) if lab == f] for f in range(cfg.fragments)]


def init_fn(cfg: LocalConfig):
    def init(params):
        leaves = jax.tree.leaves(params)
        bad = [str(x.dtype) for x in leaves if str(jnp.result_type(x)) not in _FLOATS]
        if bad:
            raise ValueError(
                f"{cfg.fn}: every parameter must be a floating array (the anchor is "
                f"kept in float32), got dtypes {sorted(set(bad))}. Fix: keep integer "
                "state out of the parameters (e.g. in a flax collection)."
            )
        # a copy, never the parameters' own buffer (or a step donating both
        # parameters and state would donate it twice)
        anchor = [jnp.array(x, jnp.float32, copy=True) for x in leaves]
        sl = _slicing(cfg, params, strict=False)
        if sl is not None:  # this replica's slices only (a copy each)
            anchor = sl[0].take(anchor, sl[1].index)
        frags = _fragments(cfg, params)
        outer = tuple(cfg.outer.init([anchor[k] for k in ks]) for ks in frags)
        held = ()
        if cfg.lane is not None:  # a handle per fragment (-1: none in flight)
            held = tuple(jnp.array(-1, jnp.int32) for _ in frags)
        elif cfg.delay:
            held = tuple(([jnp.zeros_like(anchor[k]) for k in ks], jnp.array(True)) for ks in frags)
        return LocalUpdatesState(
            step=jnp.zeros((), jnp.int32),
            anchor=jax.tree.unflatten(jax.tree.structure(params), anchor),
            outer_state=outer,
            inner_state=cfg.inner.init(params),
            skipped=jnp.zeros((), jnp.int32),
            held=held,
            diverged=_flags(leaves, jnp.zeros((len(frags),), bool)),
        )

    return init


def _agree(cfg: LocalConfig, step, params, state):
    """Processes that disagree on the schedule or the tree fail the first step on
    every process with the same message (never a hang in a later outer mean).

    Over every process of the job (``cfg.world``), not the outer mean's
    communicator: two processes of one island that differ would otherwise fail
    only with their same-rank peers, the rest waiting for them in the inner
    mean. The check is the step's first native call: every MPI call of the step
    (the inner chain's too) follows it in the token chain."""
    backend = cfg.world if cfg.world is not None else cfg.sync.backend
    if not isinstance(backend, _mpi_backend.MPIBackend):
        return step
    shapes = [(str(x.dtype), tuple(x.shape)) for x in jax.tree.leaves(params)]
    text = (
        f"{cfg.describe()}\nparameters {jax.tree.structure(params)} {shapes}\n"
        f"outer state {jax.tree.structure(state.outer_state)} outer probe {_probe(cfg.outer)}"
    )
    (out,) = backend.agree(text, f"{cfg.fn} configuration", [step[None]], alone=True)
    return out[0]


def _probe(outer) -> str:
    """The outer optimizer's updates of a fixed pseudo-gradient over two steps:
    islands whose outer learning rate or momentum differ (the state's structure
    alike) get different numbers, so the agreement names them instead of the
    anchors drifting apart. Computed while tracing, outside the step."""
    try:
        with jax.ensure_compile_time_eval():
            p = {"x": jnp.asarray([1.0, -0.5], jnp.float32)}
            s, out = outer.init(p), []
            for g in ([1.0, 0.25], [-0.5, 2.0]):
                u, s = outer.update({"x": jnp.asarray(g, jnp.float32)}, s, p)
                out += [f"{float(v):.9g}" for v in u["x"]]
        return " ".join(out)
    except Exception as e:  # noqa: BLE001 - an outer optimizer the probe cannot drive
        return f"(no probe: {type(e).__name__})"


def _turn(n, cfg: LocalConfig, f: int):
    """Whether local step ``n`` (1-based) is fragment ``f``'s sync step."""
    k = cfg.every // cfg.fragments
    return (n > 0) & (n % k == 0) & ((n // k - 1) % cfg.fragments == f)


def _mean(cfg: LocalConfig, pg):
    """The pseudo-gradient's mean over islands and whether it is all finite
    (one flag, the same on every island: it is read from the synced mean)."""
    c = cfg.outer_mean
    pg = _as_varying(pg, tuple(c.axes) + tuple(c.backend.mesh_axes))
    mean, finite = sync(pg, c)
    if cfg.slices is not None:  # each replica saw its slice: all of the island decide
        bad, _ = sync([(~finite).astype(jnp.float32)], cfg.slices)
        finite = bad[0] == 0
        mean = [_invariance._varying(m, _invariance._vma(x)) for m, x in zip(mean, pg)]
    return mean, finite


def _outer(cfg: LocalConfig, mean, finite, anchor, ostate):
    """The outer update of one fragment's anchor; skipped (unchanged) when not finite."""
    upd, new_state = cfg.outer.update(mean, ostate, anchor)
    new_anchor = optax.apply_updates(anchor, upd)
    pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)  # noqa: E731
    return pick(new_anchor, anchor), pick(new_state, ostate)


def _in_flight(cfg: LocalConfig, send, apply, handle, a_f, loc):
    """overlap=True: start the fragment's mean at its send step, take it at apply."""
    from . import _inflight

    handle = lax.cond(
        send,
        lambda args: _inflight.start(cfg.lane, cfg.outer_mean, [x - y for x, y in zip(*args)]),
        lambda _: handle,
        (a_f, loc),
    )

    def take(h):
        mean = _inflight.finish(cfg.lane, cfg.outer_mean, h, a_f)
        return mean, jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in mean]))

    def idle(h):
        return [jnp.zeros(x.shape, x.dtype) for x in a_f], jnp.array(True)

    mean, finite = lax.cond(apply, take, idle, handle)
    # taken: none in flight now (in_flight() of a later state must not name it)
    return mean, finite, jnp.where(apply, jnp.int32(-1), handle)


def update_fn(cfg: LocalConfig):
    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError(
                f"{cfg.fn}: update needs params (it sets them at every outer step). "
                "Fix: tx.update(grads, state, params)."
            )
        if not isinstance(state, LocalUpdatesState):
            raise TypeError(
                f"{cfg.fn}: update got a state of type {type(state).__name__}, expected "
                "LocalUpdatesState from this transform's init."
            )
        step = _agree(cfg, state.step, params, state)
        n = step - cfg.warmup + 1  # this step's local step (<= 0: warmup)
        grads = updates
        if cfg.warmup:
            # Post-local SGD's first phase: synchronous data parallel, the
            # gradients averaged over every island (the inner mean then averages
            # values already equal on the island).
            def dense(g):
                leaves, tdef = jax.tree.flatten(g)
                mean, _ = sync(leaves, cfg.sync)
                # typed as the gradients were (equal on the island's replicas now)
                like = [_invariance._varying(m, _invariance._vma(x)) for m, x in zip(mean, leaves)]
                return jax.tree.unflatten(tdef, like)

            grads = _select_phase(n > 0, lambda g: g, dense, grads, cfg.sync)
        with guard(cfg.islands, cfg.fn):
            u, inner_state = cfg.inner.update(grads, state.inner_state, params, **extra)
        local = optax.apply_updates(params, u)
        p_leaves, tdef = jax.tree.flatten(params)
        u_leaves = tdef.flatten_up_to(u)
        l_leaves = tdef.flatten_up_to(local)
        frags = _fragments(cfg, params)
        # A non-finite inner step never reaches the parameters (p + u cannot turn
        # a NaN back): the island keeps its parameters and inner state and idles;
        # after the warm-up it is flagged, its pseudo-gradient travels as NaN (so
        # the outer step is skipped everywhere), and each fragment's outer step
        # sets it back to the anchor and lowers the fragment's flag.
        ok = jnp.array(True)
        for x in l_leaves:
            ok = ok & jnp.all(jnp.isfinite(x))
        flags = state.diverged
        if isinstance(flags, tuple):  # a state made before the flags existed
            flags = _flags(p_leaves, jnp.zeros((len(frags),), bool))
        live = jnp.array([bool(ks) for ks in frags])
        hold = ~ok | jnp.any(flags)
        flags = flags | (~ok & (n > 0) & live)
        u_leaves = [jnp.where(hold, jnp.zeros_like(x), x) for x in u_leaves]
        l_leaves = [jnp.where(hold, p, x) for p, x in zip(p_leaves, l_leaves)]
        inner_state = jax.tree.map(lambda a, b: _held(hold, a, b), state.inner_state, inner_state)
        anchor = tdef.flatten_up_to(state.anchor)
        sl = _slicing(cfg, params)
        l32 = [x.astype(jnp.float32) for x in l_leaves]
        l_mine = l32 if sl is None else sl[0].take(l32, sl[1].index)  # the anchor's part
        if cfg.warmup:  # the anchor follows the (identical) parameters until then
            anchor = [jnp.where(n <= 0, x, a) for x, a in zip(l_mine, anchor)]
        _digest.check_at_first_outer_step(cfg, n, step, anchor)
        new = list(l_leaves)
        changed = [jnp.array(False)] * len(p_leaves)
        ostates, held = list(state.outer_state), list(state.held)
        skipped, applied = state.skipped, jnp.array(False)
        for f, ks in enumerate(frags):
            if not ks:  # fewer leaves than fragments: this turn moves nothing
                continue
            a_f = [anchor[k] for k in ks]
            loc = [jnp.where(flags[f], jnp.nan, l_mine[k]) for k in ks]
            send = _turn(n, cfg, f)

            def mean_of(args, like=held[f][0] if cfg.delay and cfg.lane is None else None):
                a, lo = args
                mean, finite = _mean(cfg, [x - y for x, y in zip(a, lo)])
                if like is not None:  # typed as the held values (shard_map)
                    mean = [
                        _invariance._varying(m, _invariance._vma(h)) for m, h in zip(mean, like)
                    ]
                return mean, finite

            def idle(args):
                a, _ = args
                zeros = [jnp.zeros(x.shape, x.dtype) for x in a]
                if cfg.slices is not None:  # typed as the sliced mean (shard_map)
                    zeros = [_invariance._varying(z, _invariance._vma(x)) for z, x in zip(zeros, a)]
                return zeros, jnp.array(True)

            if cfg.lane is not None:
                mean, finite, held[f] = _in_flight(
                    cfg, send, _turn(n - cfg.delay, cfg, f), held[f], a_f, loc
                )
                apply = _turn(n - cfg.delay, cfg, f)
            elif cfg.delay:
                got = _select_phase(
                    ~send, lambda _, h=held[f]: h, mean_of, (a_f, loc), cfg.outer_mean
                )
                held[f] = got
                apply = _turn(n - cfg.delay, cfg, f)
                mean, finite = got
            else:
                mean, finite = _select_phase(~send, idle, mean_of, (a_f, loc), cfg.outer_mean)
                apply = send

            def outer_step(args, finite=finite):
                m, a, o = args
                return _outer(cfg, m, finite, a, o)

            a_f, ostates[f] = lax.cond(
                apply, outer_step, lambda args: (args[1], args[2]), (mean, a_f, ostates[f])
            )
            skipped = skipped + (apply & ~finite).astype(jnp.int32)
            applied = applied | apply
            whole = a_f
            if sl is not None:  # the new anchor's slices, gathered at an apply step
                like = [_invariance._vma(l32[k]) for k in ks]  # both branches typed alike

                def gathered(xs, ks=ks, like=like):
                    got = _gather(cfg, sl, ks, xs)
                    return [_invariance._varying(x, v) for x, v in zip(got, like)]

                def unused(xs, ks=ks, like=like):
                    zeros = [jnp.zeros(l32[k].shape, jnp.float32) for k in ks]
                    return [_invariance._varying(x, v) for x, v in zip(zeros, like)]

                whole = _select_phase(apply, gathered, unused, a_f, cfg.slices)
            for j, k in enumerate(ks):
                anchor[k] = a_f[j]
                target = whole[j]
                if cfg.mix:  # not at a skipped step, nor into a flagged island
                    mixed = (1.0 - cfg.mix) * whole[j] + cfg.mix * l32[k]
                    target = jnp.where(finite & ~flags[f], mixed, whole[j])
                new[k] = jnp.where(apply, target.astype(p_leaves[k].dtype), new[k])
                changed[k] = apply
            flags = flags.at[f].set(flags[f] & ~apply)
        out = [
            jnp.where(c, (x - p).astype(uk.dtype), uk)
            for c, x, p, uk in zip(changed, new, p_leaves, u_leaves)
        ]
        if cfg.reset_inner:
            fresh = cfg.inner.init(jax.tree.unflatten(tdef, new))
            inner_state = jax.tree.map(lambda a, b: jnp.where(applied, a, b), fresh, inner_state)
        return jax.tree.unflatten(tdef, out), LocalUpdatesState(
            step=step + 1,
            anchor=jax.tree.unflatten(tdef, anchor),
            outer_state=tuple(ostates),
            inner_state=inner_state,
            skipped=skipped,
            held=tuple(held),
            diverged=flags,
        )

    return update
