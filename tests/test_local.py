"""jaxsync.local (DiLoCo, local SGD, BMUF, streaming) against closed forms, in one
process: the islands are a mesh axis ("island", "replica") of 8 fake devices
under shard_map. Each device d holds the quadratic 1/2 |x - c_d|^2 (gradient
x - c_d); values are dyadic, so where the float64 reference is exact the float32
result is compared bitwise, elsewhere within a stated bound."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import raises_then_clean
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync

AX = ("island", "replica")
C = np.array([[3.0, -5.0], [1.0, 7.0], [-2.0, 4.0], [6.0, 0.0],
              [0.0, 2.0], [-7.0, 1.0], [5.0, -3.0], [2.0, 6.0]])  # fmt: skip
X0 = np.array([4.0, -2.0])


def _mesh(islands):
    return Mesh(np.array(jax.devices()).reshape(islands, 8 // islands), AX)


def _isl():
    return jaxsync.islands(jaxsync.AxisComm("island"), axis_name="replica", comm=None)


def _inner(lr, **kw):
    return optax.chain(
        jaxsync.hierarchical_mean(axis_name="replica", comm=None), optax.sgd(lr, **kw)
    )


def run(tx, islands, steps, c=C, x0=X0, bad=None, first_only=False):
    """Params and anchor after every step, per device: (8, steps, 2) each.
    ``bad=(step, device)`` feeds that device a NaN gradient at that step (in its
    first element only with ``first_only``)."""

    def body(c):
        # varying from the start: the scan's carry keeps one type
        p = {"x": jax.lax.pcast(jnp.asarray(x0, jnp.float32), AX, to="varying")}
        me = jax.lax.axis_index(AX)

        def step(carry, t):
            p, s = carry
            g = p["x"] - c[0]
            if bad is not None:
                hit = (me == bad[1]) & (t == bad[0]) & ((jnp.arange(2) == 0) | (not first_only))
                g = jnp.where(hit, jnp.nan, g)
            u, s = tx.update({"x": g}, s, p)
            p = optax.apply_updates(p, u)
            return (p, s), (p["x"], s.anchor["x"], s.skipped)

        _, (ps, anchors, skipped) = jax.lax.scan(step, (p, tx.init(p)), jnp.arange(steps))
        return ps[None], anchors[None], skipped[None]

    f = jax.shard_map(body, mesh=_mesh(islands), in_specs=P(AX), out_specs=P(AX))
    return [np.asarray(a) for a in jax.jit(f)(jnp.asarray(C if c is None else c, jnp.float32))]


def islands_c(islands):
    """Each island's mean target (the inner mean's)."""
    return C.reshape(islands, 8 // islands, 2).mean(axis=1)


def local_steps(x, c, lr, h):
    for _ in range(h):
        x = x - lr * (x - c)
    return x


@pytest.mark.parametrize("islands", [2, 4])
def test_h1_outer_sgd1_is_data_parallel_sgd(islands):
    tx = jaxsync.diloco(_inner(0.5), optax.sgd(1.0), every=1, islands=_isl())
    ps, anchors, _ = run(tx, islands, 5)
    x = X0.copy()
    for t in range(5):
        x = x - 0.5 * (x - C.mean(axis=0))  # synchronous data parallel, sgd(0.5)
        np.testing.assert_array_equal(ps[:, t], np.broadcast_to(x, (8, 2)))
        np.testing.assert_array_equal(anchors[:, t], np.broadcast_to(x, (8, 2)))


def test_h1_outer_momentum_is_data_parallel_momentum():
    eta, zeta, mu = 0.5, 0.5, 0.5
    tx = jaxsync.diloco(_inner(eta), optax.sgd(zeta, momentum=mu), every=1, islands=_isl())
    ps, _, _ = run(tx, 2, 5)
    x, m = X0.copy(), np.zeros(2)
    for t in range(5):  # data parallel sgd(eta * zeta, momentum mu)
        m = mu * m + (x - C.mean(axis=0))
        x = x - eta * zeta * m
        np.testing.assert_array_equal(ps[:, t], np.broadcast_to(x, (8, 2)))


def test_one_island_is_optax_lookahead():
    h, alpha = 3, 0.5
    inner = optax.sgd(0.5, momentum=0.5)
    tx = jaxsync.diloco(
        optax.chain(jaxsync.hierarchical_mean(axis_name="replica", comm=None), inner),
        optax.sgd(alpha),
        every=h,
        islands=_isl(),
    )
    ps, anchors, _ = run(tx, 1, 7)
    la = optax.lookahead(inner, sync_period=h, slow_step_size=alpha)
    lp = optax.LookaheadParams.init_synced({"x": jnp.asarray(X0, jnp.float32)})
    ls = la.init(lp)
    la_update = jax.jit(la.update)
    for t in range(7):
        g = {"x": lp.fast["x"] - jnp.asarray(C.mean(axis=0), jnp.float32)}
        with jax.numpy_dtype_promotion("standard"):  # optax multiplies by a bool
            u, ls = la_update(g, ls, lp)
        lp = optax.apply_updates(lp, u)
        np.testing.assert_array_equal(ps[:, t], np.broadcast_to(lp.fast["x"], (8, 2)))
        np.testing.assert_array_equal(anchors[:, t], np.broadcast_to(lp.slow["x"], (8, 2)))


@pytest.mark.parametrize("nesterov", [False, True])
def test_bmuf_is_caffe2s_recurrence(nesterov):
    h, lr, n, zeta = 2, 0.5, 2, 1.0
    eta = 1.0 - 1.0 / n  # block_momentum=None
    tx = jaxsync.bmuf(_inner(lr), every=h, nesterov=nesterov, islands=_isl())
    ps, anchors, _ = run(tx, n, 3 * h)
    ci = islands_c(n)
    theta_g, v, start = X0.copy(), np.zeros(2), X0.copy()
    for block in range(3):
        avg = np.mean([local_steps(start, ci[i], lr, h) for i in range(n)], axis=0)
        v = eta * v + zeta * (avg - theta_g)  # Caffe2's Parallelize_BMUF
        theta_g = theta_g + v
        start = theta_g + eta * v if nesterov else theta_g
        np.testing.assert_array_equal(ps[:, block * h + h - 1], np.broadcast_to(start, (8, 2)))
        np.testing.assert_array_equal(anchors[:, block * h + h - 1], np.broadcast_to(start, (8, 2)))


def test_bmuf_warmup_is_data_parallel_then_blocks():
    """warmup=w: w synchronous steps (the gradient's mean over every island),
    then Caffe2's block recurrence from the point they reached."""
    h, lr, n, w = 2, 0.5, 2, 3
    eta = 1.0 - 1.0 / n
    tx = jaxsync.bmuf(_inner(lr), every=h, warmup=w, islands=_isl())
    ps, anchors, _ = run(tx, n, w + 2 * h)
    x = X0.copy()
    for t in range(w):
        x = x - lr * (x - C.mean(axis=0))
        np.testing.assert_array_equal(ps[:, t], np.broadcast_to(x, (8, 2)))
        np.testing.assert_array_equal(anchors[:, t], np.broadcast_to(x, (8, 2)))
    ci = islands_c(n)
    theta_g, v = x.copy(), np.zeros(2)
    for block in range(2):
        avg = np.mean([local_steps(theta_g, ci[i], lr, h) for i in range(n)], axis=0)
        v = eta * v + (avg - theta_g)
        theta_g = theta_g + v
        got = ps[:, w + block * h + h - 1]
        np.testing.assert_array_equal(got, np.broadcast_to(theta_g, (8, 2)))


def test_anchor_follows_the_quadratics_linear_recurrence():
    # Inner sgd(eta) for H steps on island i's 1/2|x - cbar_i|^2 ends at
    # cbar_i + q (a - cbar_i), q = (1 - eta)^H; so the pseudo-gradient mean is
    # (1 - q)(a - cbar) and DiLoCo's Nesterov outer step makes e = a - cbar
    # follow m <- mu m + (1-q) e; e <- e - lr ((1-q) e + mu m).
    h, eta, lr, mu, outer_steps = 3, 0.25, 0.7, 0.9, 5
    tx = jaxsync.diloco(_inner(eta), every=h, islands=_isl())  # DiLoCo's default outer
    _, anchors, _ = run(tx, 4, h * outer_steps)
    q = (1.0 - eta) ** h
    e, m = X0 - C.mean(axis=0), np.zeros(2)
    for k in range(outer_steps):
        m = mu * m + (1 - q) * e
        e = e - lr * ((1 - q) * e + mu * m)
        got = anchors[:, (k + 1) * h - 1]
        # float32 arithmetic of a few dozen operations on values of size ~10
        np.testing.assert_allclose(got, np.broadcast_to(e + C.mean(axis=0), (8, 2)), atol=2e-5)


def test_a_nonfinite_pseudo_gradient_skips_the_outer_step_everywhere():
    tx = jaxsync.diloco(_inner(0.5), optax.sgd(1.0), every=2, islands=_isl())
    ps, anchors, skipped = run(tx, 2, 4, bad=(3, 5))  # island 1, second outer step
    a1 = anchors[:, 1]
    np.testing.assert_array_equal(anchors[:, 3], a1)  # the anchor stays, on every island
    np.testing.assert_array_equal(ps[:, 3], a1)  # and the parameters return to it
    assert np.isfinite(ps).all() and np.isfinite(anchors).all()
    np.testing.assert_array_equal(skipped[:, 3], np.ones(8))
    np.testing.assert_array_equal(skipped[:, 1], np.zeros(8))


def test_an_inner_mean_across_islands_is_refused():
    inner = optax.chain(jaxsync.hierarchical_mean(axis_name=AX, comm=None), optax.sgd(0.5))
    tx = jaxsync.diloco(inner, every=2, islands=_isl())
    with pytest.raises(ValueError, match="spans the mesh axis 'island'.*isl.axis_name"):
        run(tx, 2, 1)


def test_local_sgd_warmup_is_data_parallel_then_averages():
    h, w, lr = 2, 3, 0.5
    tx = jaxsync.local_sgd(_inner(lr, momentum=0.5), every=h, warmup=w, islands=_isl())
    ps, _, _ = run(tx, 2, w + 2 * h)
    ci = islands_c(2)
    x, m = X0.copy(), np.zeros(2)
    for t in range(w):  # gradients averaged over every island, momentum on them
        m = 0.5 * m + (x - C.mean(axis=0))
        x = x - lr * m
        np.testing.assert_array_equal(ps[:, t], np.broadcast_to(x, (8, 2)))
    xs, ms = [x.copy(), x.copy()], [m.copy(), m.copy()]  # inner state kept
    for block in range(2):
        for _ in range(h):
            for i in range(2):
                ms[i] = 0.5 * ms[i] + (xs[i] - ci[i])
                xs[i] = xs[i] - lr * ms[i]
        avg = (xs[0] + xs[1]) / 2
        xs = [avg.copy(), avg.copy()]
        np.testing.assert_array_equal(ps[:, w + block * h + h - 1], np.broadcast_to(avg, (8, 2)))


def streaming_reference(h, frags, delay, mix, lr, outer_lr, steps, n=2):
    """Streaming DiLoCo written out: leaf k in fragment k % P (here the two
    coordinates are two leaves), fragment f sent at local step n with
    n % (H/P) == 0 and (n/(H/P) - 1) % P == f, applied delay steps later."""
    ci = islands_c(n)
    xs = [X0.copy() for _ in range(n)]
    anchor, held, out = X0.copy(), {}, []
    k = h // frags
    for t in range(1, steps + 1):
        xs = [local_steps(x, ci[i], lr, 1) for i, x in enumerate(xs)]
        for f in range(frags):
            idx = [j for j in range(2) if j % frags == f]
            if t % k == 0 and (t // k - 1) % frags == f:
                held[f] = np.mean([anchor[idx] - x[idx] for x in xs], axis=0)
            s = t - delay
            if s > 0 and s % k == 0 and (s // k - 1) % frags == f:
                anchor[idx] = anchor[idx] - outer_lr * held.pop(f)
                for x in xs:
                    x[idx] = (1 - mix) * anchor[idx] + mix * x[idx]
        out.append(np.stack(xs))
    return out


def run_leaves(tx, islands, steps):
    """As run, with the two coordinates as two leaves (so fragments can split them)."""

    def body(c):
        x = jax.lax.pcast(jnp.asarray(X0, jnp.float32), AX, to="varying")
        p = {"a": x[:1], "b": x[1:]}

        def step(carry, _):
            p, s = carry
            g = {"a": p["a"] - c[0, :1], "b": p["b"] - c[0, 1:]}
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            return (p, s), jnp.concatenate([p["a"], p["b"]])

        _, out = jax.lax.scan(step, (p, tx.init(p)), None, length=steps)
        return out[None]

    f = jax.shard_map(body, mesh=_mesh(islands), in_specs=P(AX), out_specs=P(AX))
    return np.asarray(jax.jit(f)(jnp.asarray(C, jnp.float32)))


@pytest.mark.parametrize(
    "frags,delay,mix", [(1, 0, 0.0), (2, 0, 0.0), (2, 1, 0.5)], ids=["diloco", "P2", "P2tau1mix"]
)
def test_streaming_follows_its_schedule(frags, delay, mix):
    h, lr, olr, steps = 4, 0.5, 0.5, 9
    tx = jaxsync.diloco(
        _inner(lr), optax.sgd(olr), every=h, islands=_isl(), fragments=frags, delay=delay, mix=mix
    )
    got = run_leaves(tx, 2, steps)
    want = streaming_reference(h, frags, delay, mix, lr, olr, steps)
    for t in range(steps):
        island_rows = got[[0, 4], t]
        np.testing.assert_array_equal(island_rows, want[t])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"every": 0}, "every must be >= 1"),
        ({"every": 4, "fragments": 3}, "not a multiple of fragments"),
        ({"every": 4, "fragments": 2, "delay": 2}, "delay=2 must be < every/fragments=2"),
        ({"every": 4, "mix": 1.5}, "mix must be"),
        ({"every": 4, "outer": lambda g: g}, "outer"),
        ({"every": 2.0}, "every"),
        ({"every": 4, "fragments": 2, "delay": 1, "overlap": True}, "overlap=True needs"),
        (
            {"every": 4, "fragments": 2, "delay": 1, "overlap": True, "comm_dtype": "int8"},
            "a quantized wire",
        ),
    ],
)
def test_bad_configuration_fails_in_the_factory(kw, match):
    if kw.get("comm_dtype") == "int8":
        kw = {**kw, "comm_dtype": jaxsync.Quantized(bits=8)}
    with pytest.raises((ValueError, TypeError), match=match):
        jaxsync.diloco(optax.sgd(0.1), islands=_isl(), **kw)
    with pytest.raises(ValueError, match="block_momentum"):
        jaxsync.bmuf(optax.sgd(0.1), 4, block_momentum=1.0, islands=_isl())


def test_bfloat16_parameters_keep_a_float32_anchor():
    tx = jaxsync.diloco(optax.sgd(0.5), optax.sgd(1.0), every=2, islands=jaxsync.islands(comm=None))
    p = {"x": jnp.array([1.0, 3.0], jnp.bfloat16)}
    s = tx.init(p)
    assert s.anchor["x"].dtype == jnp.float32
    step = jax.jit(tx.update)
    for _ in range(2):
        u, s = step({"x": jnp.array([1.0, 1.0], jnp.bfloat16)}, s, p)
        p = optax.apply_updates(p, u)
    assert p["x"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(p["x"], np.float32), [0.0, 2.0])


def test_vmap_and_pmap_islands_follow_the_reference():
    # Under vmap the step count is batched: both branches run and are selected.
    tx = jaxsync.diloco(_inner(0.5), optax.sgd(0.5, momentum=0.5), every=2, islands=_isl())

    def body(c):
        p = {"x": jnp.asarray(X0, jnp.float32)}
        s = tx.init(p)
        for _ in range(4):
            u, s = tx.update({"x": p["x"] - c}, s, p)
            p = optax.apply_updates(p, u)
        return s.anchor["x"]

    c = jnp.asarray(C.reshape(2, 4, 2), jnp.float32)
    ci = islands_c(2)
    anchor, m = X0.copy(), None
    for _ in range(2):
        pg = np.mean([anchor - local_steps(anchor, ci[i], 0.5, 2) for i in range(2)], axis=0)
        m = pg if m is None else 0.5 * m + pg
        anchor = anchor - 0.5 * m
    want = np.broadcast_to(anchor, (2, 4, 2))
    inner_map = jax.vmap(body, axis_name="replica")
    got = jax.jit(jax.vmap(inner_map, axis_name="island"))(c)
    np.testing.assert_array_equal(np.asarray(got), want)
    got = jax.pmap(inner_map, axis_name="island")(c)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_a_checkpoint_between_send_and_apply_resumes_alike(tmp_path):
    # delay=1: saved right after fragment 0's send step, its mean held in the state.
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = jaxsync.diloco(
        optax.sgd(0.125, momentum=0.5),
        every=4,
        fragments=2,
        delay=1,
        islands=jaxsync.islands(comm=None),
    )

    def step(p, s):
        u, s = tx.update(jax.tree.map(lambda x: x - 2.0, p), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step)
    p = {"a": jnp.ones(3), "b": jnp.arange(4.0)}
    s = tx.init(p)
    for _ in range(2):
        p, s = step(p, s)
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "ck", {"p": p, "s": s})
    ck.wait_until_finished()
    r = ck.restore(tmp_path / "ck", jax.eval_shape(lambda: {"p": p, "s": s}))
    p2, s2 = r["p"], r["s"]
    for _ in range(5):
        p, s = step(p, s)
        p2, s2 = step(p2, s2)
    for x, y in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p2, s2))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(p["a"]), np.ones(3))


def _streaming(overlap, comm_dtype=None):
    """Streaming DiLoCo over one process's own communicator (MPI_COMM_SELF: one
    island, so the outer mean is the island's own pseudo-gradient), the mean
    held in the state or, ``overlap=True``, in flight on the native lane."""
    import dataclasses

    from mpi4py import MPI

    # one island whose outer communicator is this process alone (islands() gives a
    # lone island none: there is no peer to exchange with)
    isl = dataclasses.replace(jaxsync.islands("process", comm=None), outer_comm=MPI.COMM_SELF)
    return jaxsync.diloco(
        optax.sgd(0.125, momentum=0.5),
        optax.sgd(0.5, momentum=0.5),
        every=4,
        fragments=2,
        delay=1,
        mix=0.5,
        islands=isl,
        overlap=overlap,
        comm_dtype=comm_dtype,
    )


def _stream_step(tx):
    def body(p, s):
        u, s = tx.update(jax.tree.map(lambda x: x - 2.0, p), s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(body, donate_argnums=(0, 1))


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_the_native_inflight_sum_matches_the_held_form_and_resumes_mid_flight(tmp_path, wire):
    """overlap=True: the fragment's sum starts at its send step in one jitted call
    and is taken ``delay`` steps later in another (jaxsync_inflight_start/_finish).
    Bitwise the held form's (dyadic values). A state saved between a send and its
    apply step resumes with its sum (in_flight / resume_in_flight), and a handle
    this process does not hold (a checkpoint restored without its sums) fails
    the apply step with an error that names the fix."""
    # b's values need float32's bits: a bfloat16 wire rounds them (held and in flight alike)
    params = {"a": jnp.ones(3), "b": jnp.arange(4.0) / 3, "c": jnp.full((2, 2), -1.0)}
    dt = None if wire == "float32" else jnp.bfloat16
    size = 4 if dt is None else 2  # bytes an element on the wire
    held_tx, fly_tx = _streaming(False, dt), _streaming(True, dt)
    held, fly = _stream_step(held_tx), _stream_step(fly_tx)
    p, s = jax.tree.map(jnp.copy, params), held_tx.init(params)
    q, t = jax.tree.map(jnp.copy, params), fly_tx.init(params)  # each step donates its own
    with jaxsync.timeline(tmp_path) as tl:
        for k in range(9):
            p, s = held(p, s)
            with tl.step(f"fly {k}"):
                q, t = jax.block_until_ready(fly(q, t))
            if k == 5:  # fragment 0 was sent at step 6 (1-based): in flight now
                assert int(t.held[0]) >= 0 and int(t.held[1]) == -1, t.held
                saved = jaxsync.local.in_flight(t)
                assert [x.size for x in saved] == [4 + 7 * size, 0], saved  # divisor, 7 elements
                snap = jax.tree.map(np.array, (q, t))  # a checkpoint's host copy
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(s.anchor["b"]), np.asarray(t.anchor["b"]))
    assert not np.array_equal(np.asarray(q["b"]), np.asarray(params["b"]))
    assert [int(h) for h in t.held] == [-1, -1]  # every sum taken
    # The timeline shows each sum on the lane, queued in its send step (1-based 2, 4,
    # 6, 8: fragments 0, 1, 0, 1, with 7 and 4 float32 each).
    doc = json.loads(tl.path.read_text())
    marks = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"}
    got = []
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["args"].get("communicator") == "islands' outer mean (in flight)":
            queued = e["ts"] - e["args"]["queued_us"]
            (step,) = [n for n, m in marks.items() if m["ts"] <= queued <= m["ts"] + m["dur"]]
            got.append((step, e["args"]["bytes"]))
    want = [(f"step fly {k}", n * size) for k, n in ((1, 7), (3, 4), (5, 7), (7, 4))]
    assert got == want, got

    q2, t2 = jax.tree.map(jnp.asarray, snap)
    t2 = jaxsync.local.resume_in_flight(t2, saved)
    for _ in range(3):  # steps 7-9: fragment 0 applied from the saved sum
        q2, t2 = fly(q2, t2)
    for x, y in zip(jax.tree.leaves(q), jax.tree.leaves(q2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    q3, t3 = jax.tree.map(jnp.asarray, snap)
    t3 = t3._replace(held=(jnp.array(10**6, jnp.int32), t3.held[1]))
    with pytest.raises(Exception, match=r"no transfer in flight with handle 1000000.*in_flight"):
        jax.block_until_ready(fly(q3, t3))
    with pytest.raises(ValueError, match="saved has 1 entries, the state 2 fragments"):
        jaxsync.local.resume_in_flight(t, saved[:1])
    # the held form keeps its means in the state: nothing in flight, nothing to resume
    assert [x.size for x in jaxsync.local.in_flight(s)] == [0, 0]
    same = jaxsync.local.resume_in_flight(s, [np.zeros(0, np.uint8)] * 2)
    for x, y in zip(jax.tree.leaves(same.held), jax.tree.leaves(s.held)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("make", ["diloco", "bmuf_nesterov", "streaming"])
def test_a_step_that_donates_params_and_state_runs(make):
    """``jax.jit(step, donate_argnums=(0, 1))`` on ``tx.init(params)``'s state (the
    step the docs write): the state's float32 anchor (and Nesterov BMUF's copy of
    it) aliased the parameters, and XLA refused to donate a buffer twice."""
    isl = jaxsync.islands("process", comm=None)
    inner = optax.sgd(0.5)
    tx = {
        "diloco": lambda: jaxsync.diloco(inner, every=2, islands=isl),
        "bmuf_nesterov": lambda: jaxsync.bmuf(inner, every=2, nesterov=True, islands=isl),
        "streaming": lambda: jaxsync.diloco(inner, every=2, islands=isl, fragments=2, delay=0),
    }[make]()
    params = {"a": jnp.arange(4.0), "b": jnp.ones(3)}

    def body(p, s):
        u, s = tx.update(jax.tree.map(lambda x: x - 1, p), s, p)
        return optax.apply_updates(p, u), s

    want, ws = params, tx.init(params)  # the same steps, nothing donated
    for _ in range(3):
        want, ws = jax.jit(body)(want, ws)
    step = jax.jit(body, donate_argnums=(0, 1))
    p, s = params, tx.init(params)
    for _ in range(3):
        p, s = step(p, s)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((want, ws))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("new", [2, 8])
def test_regroup_resumes_on_another_island_count(new):
    """4 islands (a vmap axis) run 4 steps of DiLoCo (H = 2, inner sgd with
    momentum, outer sgd with momentum), are saved after the outer step and
    resumed as ``new`` islands with ``regroup``: the anchor and outer momentum
    carry over, island i takes saved island i % 4's inner momentum, and each
    island starts from the anchor. 4 more steps on the new islands' targets
    follow the float64 recurrence (dyadic values: exact)."""
    isl = jaxsync.islands(jaxsync.AxisComm("island"), comm=None)
    tx = jaxsync.diloco(
        optax.sgd(0.5, momentum=0.5), optax.sgd(0.5, momentum=0.5), every=2, islands=isl
    )

    def steps(p, s, c, k):
        for _ in range(k):
            u, s = tx.update({"x": p["x"] - c}, s, p)
            p = optax.apply_updates(p, u)
        return p, s

    run = jax.jit(jax.vmap(lambda p, s, c: steps(p, s, c, 4), axis_name="island"))
    x0 = jnp.broadcast_to(jnp.asarray(X0, jnp.float32), (4, 2))
    s0 = jax.vmap(tx.init)({"x": x0})
    c1 = jnp.asarray(C[:4], jnp.float32)
    p1, s1 = run({"x": x0}, s0, c1)
    saved = [jax.tree.map(lambda a, i=i: a[i], s1) for i in range(4)]
    regrouped = jaxsync.local.regroup(saved, islands=new)
    s2 = jax.tree.map(lambda *xs: jnp.stack(xs), *regrouped)
    c2 = jnp.asarray(np.resize(C[::-1], (new, 2)), jnp.float32)
    p2, s2 = run({"x": jnp.broadcast_to(s2.anchor["x"], (new, 2))}, s2, c2)

    def reference(anchor, m_out, moms, cs, outer_steps):
        for _ in range(outer_steps):
            xs = []
            for i, c in enumerate(cs):
                x = anchor.copy()
                for _ in range(2):
                    moms[i] = 0.5 * moms[i] + (x - c)
                    x = x - 0.5 * moms[i]
                xs.append(x)
            pg = np.mean([anchor - x for x in xs], axis=0)
            m_out = pg if m_out is None else 0.5 * m_out + pg
            anchor = anchor - 0.5 * m_out
        return anchor, m_out, moms

    anchor, m_out, moms = reference(X0.copy(), None, [np.zeros(2)] * 4, C[:4], 2)
    np.testing.assert_array_equal(np.asarray(s1.anchor["x"][0]), anchor)
    moms = [moms[i % 4].copy() for i in range(new)]
    anchor, m_out, moms = reference(anchor, m_out, moms, np.resize(C[::-1], (new, 2)), 2)
    np.testing.assert_array_equal(np.asarray(s2.anchor["x"]), np.broadcast_to(anchor, (new, 2)))
    np.testing.assert_array_equal(np.asarray(p2["x"]), np.broadcast_to(anchor, (new, 2)))


def test_regroup_refuses_states_of_different_steps_and_sums_in_flight():
    tx = jaxsync.diloco(optax.sgd(0.5), every=2, islands=jaxsync.islands(comm=None))
    s = tx.init({"x": jnp.ones(2)})
    with pytest.raises(ValueError, match="island 1's step differs from island 0's"):
        jaxsync.local.regroup([s, s._replace(step=jnp.array(1, jnp.int32))], islands=2)
    with pytest.raises(ValueError, match=r"1 sum\(s\) in flight"):
        jaxsync.local.regroup([s._replace(held=(jnp.array(3, jnp.int32),))], islands=2)
    with pytest.raises(ValueError, match="islands must be a Python int >= 1"):
        jaxsync.local.regroup([s], islands=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda sl: jaxsync.diloco(
            _inner(0.5), optax.sgd(0.5, momentum=0.5), every=2, islands=_isl(), slice_anchor=sl
        ),
        lambda sl: jaxsync.bmuf(_inner(0.5), 2, nesterov=True, islands=_isl(), slice_anchor=sl),
        lambda sl: jaxsync.local_sgd(_inner(0.5), 2, warmup=2, islands=_isl(), slice_anchor=sl),
        lambda sl: jaxsync.diloco(
            jaxsync.sharded(optax.sgd(0.5, momentum=0.5), axis_name="replica", comm=None),
            every=2,
            islands=_isl(),
            slice_anchor=sl,
        ),
    ],
    ids=["diloco", "bmuf_nesterov", "local_sgd_warmup", "sharded_inner"],
)
def test_a_sliced_anchor_gives_the_same_parameters(make):
    """slice_anchor=True: each of an island's 4 replicas holds 1 of the anchor's
    4 (padded) elements and of the outer state's, the outer mean averages each
    slice over the 2 islands, and the new anchor is gathered in the island: the
    parameters are the whole anchor's, bit for bit, at every step."""
    p_full, a_full, _ = run(make(False), 2, 6)
    p_sl, a_sl, _ = run(make(True), 2, 6)
    np.testing.assert_array_equal(p_sl, p_full)
    assert a_full.shape == (8, 6, 2) and a_sl.shape == (8, 6, 1)  # 1/4 of a padded leaf
    for d in range(8):  # replica r of each island holds element r (0 and 1 are real)
        r = d % 4
        if r < 2:
            np.testing.assert_array_equal(a_sl[d, :, 0], a_full[d, :, r])


def test_slice_anchor_with_several_devices_a_process_across_processes_is_refused():
    from mpi4py import MPI

    isl = jaxsync.islands("process", axis_name="d", comm=None)
    isl = dataclasses.replace(isl, outer_comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="slice_anchor=True slices the anchor"):
        jaxsync.diloco(optax.sgd(0.1), every=2, islands=isl, slice_anchor=True)


def test_a_sliced_anchor_skips_the_outer_step_on_every_replica():
    """A NaN in one element only: with the anchor sliced, one replica's slice of
    the mean is not finite and another's is; every replica must skip (the
    decision is the island's, then every island's), never half an outer step."""
    tx = jaxsync.diloco(_inner(0.5), optax.sgd(1.0), every=2, islands=_isl(), slice_anchor=True)
    ps, anchors, skipped = run(tx, 2, 4, bad=(3, 5), first_only=True)
    full, _, _ = run(
        jaxsync.diloco(_inner(0.5), optax.sgd(1.0), every=2, islands=_isl()),
        2,
        4,
        bad=(3, 5),
        first_only=True,
    )
    np.testing.assert_array_equal(skipped[:, 3], np.ones(8))
    np.testing.assert_array_equal(anchors[:, 3], anchors[:, 1])
    np.testing.assert_array_equal(ps, full)
    assert np.isfinite(ps).all()


_MAKERS = {
    "diloco": lambda **kw: jaxsync.diloco(_inner(0.5), optax.sgd(1.0), islands=_isl(), **kw),
    "local_sgd": lambda **kw: jaxsync.local_sgd(_inner(0.5), islands=_isl(), **kw),
    "bmuf": lambda **kw: jaxsync.bmuf(_inner(0.5), islands=_isl(), **kw),
}


@pytest.mark.parametrize("make", sorted(_MAKERS))
def test_an_island_that_diverges_between_outer_steps_goes_back_to_the_anchor(make):
    """A NaN gradient at inner step 1 of 4 on island 1: its parameters never
    turn NaN (the island idles at its last finite point), the outer step at 3
    is skipped on every island, every island restarts from the anchor, and the
    next block runs as a clean first block does (bit for bit)."""
    tx = _MAKERS[make](every=4)
    ps, anchors, skipped = run(tx, 2, 8, bad=(1, 5))
    clean, clean_anchors, _ = run(_MAKERS[make](every=4), 2, 4)
    assert np.isfinite(ps).all() and np.isfinite(anchors).all()
    island1 = slice(4, 8)
    np.testing.assert_array_equal(ps[island1, 1], ps[island1, 0])  # idles at step 0's
    np.testing.assert_array_equal(ps[island1, 2], ps[island1, 0])
    np.testing.assert_array_equal(ps[:, 3], np.broadcast_to(X0, (8, 2)))  # the anchor
    np.testing.assert_array_equal(anchors[:, 3], np.broadcast_to(X0, (8, 2)))
    np.testing.assert_array_equal(skipped[:, 3], np.ones(8))
    np.testing.assert_array_equal(ps[:, 4:], clean)  # the flag is down again
    np.testing.assert_array_equal(anchors[:, 7], clean_anchors[:, 3])
    np.testing.assert_array_equal(skipped[:, 7], np.ones(8))


@pytest.mark.parametrize("delay", [0, 1])
def test_mix_takes_the_anchor_at_a_skipped_step_and_into_a_diverged_island(delay):
    """mix=0.5. delay=0: NaN at the outer step (t=3) on island 1, so the step is
    skipped: every island takes the old anchor, no mix of its own parameters.
    delay=1: NaN at t=4, after the (finite) mean was sent at t=3: the outer
    step applies; the healthy island takes the mix, the diverged one the new
    anchor alone."""
    tx = jaxsync.diloco(_inner(0.5), optax.sgd(0.5), every=4, islands=_isl(), delay=delay, mix=0.5)
    ps, anchors, skipped = run(tx, 2, 6, bad=(3 + delay, 5))
    clean, _, _ = run(
        jaxsync.diloco(_inner(0.5), optax.sgd(0.5), every=4, islands=_isl(), delay=delay, mix=0.5),
        2,
        6,
    )
    t = 3 + delay
    assert np.isfinite(ps).all()
    if delay == 0:
        np.testing.assert_array_equal(skipped[:, t], np.ones(8))
        np.testing.assert_array_equal(ps[:, t], np.broadcast_to(X0, (8, 2)))
    else:
        np.testing.assert_array_equal(skipped[:, t], np.zeros(8))
        np.testing.assert_array_equal(ps[:4, t], clean[:4, t])  # island 0: the mix
        np.testing.assert_array_equal(ps[4:, t], anchors[4:, t])  # island 1: the anchor
        assert not np.array_equal(ps[4:, t], clean[4:, t])


@pytest.mark.parametrize("warmup", [0, 2])
def test_islands_whose_anchors_differ_fail_the_first_outer_step(warmup):
    """Island 1 starts 1.0 off (as parameters changed outside the transform
    during the warm-up would be, where the anchor follows them): the first
    outer step raises on every island, naming the cause, instead of averaging
    two models. Islands that start alike pass the same step."""
    tx = jaxsync.local_sgd(_inner(0.5), every=2, warmup=warmup, islands=_isl())

    def body(c, off):
        me = jax.lax.axis_index(AX)
        p = {"x": jnp.asarray(X0, jnp.float32) + off[0] * (me >= 4).astype(jnp.float32)}

        def step(carry, _):
            p, s = carry
            u, s = tx.update({"x": p["x"] - c[0]}, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(step, (p, tx.init(p)), None, length=warmup + 2)
        return p["x"][None]

    f = jax.jit(jax.shard_map(body, mesh=_mesh(2), in_specs=(P(AX), P()), out_specs=P(AX)))
    c = jnp.asarray(C, jnp.float32)
    jax.block_until_ready(f(c, jnp.zeros(1)))
    raises_then_clean(
        lambda: f(c, jnp.ones(1)),
        lambda: f(c, jnp.zeros(1)),
        Exception,
        match=r"anchors differ at the first outer step \(step ",
    )
