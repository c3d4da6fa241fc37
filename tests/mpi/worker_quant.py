"""comm_dtype=jaxsync.Quantized(...) under MPI (jaxsync's native all-to-all and
all-gather): mpirun -n 2 x 2 devices, jit(shard_map).

* ``bytes``: one hierarchical_mean step per format under jaxsync.timeline, a
  float32 leaf of ``n = N * B * 4`` values (block B): the calls and their bytes
  (the pytest side checks them against ``2 (N - 1) / N * n * (b / 8 + 4 / B)``).
* ``property``: the hypothesis property of tests/test_quant_sync.py (derandomized,
  so every rank draws the same examples; values from the example's seed, replica
  ``r = D * rank + d`` takes row r); each rank records its replicas' results and
  whether each example held, with the failure's text.
* ``ef``: three steps of int4 error feedback: the state's residuals equal on
  every replica, and the outputs the same bits everywhere.
* ``sharded``: ``jaxsync.sharded`` with a quantized reduce-scatter: the
  timeline's bytes of one float32 leaf (per format), and two trees of
  tests/test_zero_quant.py against its float64 reference and bound (int8
  nearest; fp4 stochastic with a NaN), every rank the same values.
* ``overlap``: three steps of a four-leaf tree with ``overlap=True`` (buckets of
  512 bytes: several calls), stochastic rounding, against ``overlap=False``; and
  ``double_buffering=True`` against the plain transform (nearest), per strategy.
"""

import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _worker import local_mesh, start, to_numpy  # noqa: E402


def main():
    ns, jax, comm, rank, N, D, res = start([(("--dir",), dict(required=True))])
    import jax.numpy as jnp
    import numpy as np
    from _quant_ref import check, examples, values
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from jax.sharding import PartitionSpec as P

    import jaxsync

    res.add("meta", dict(rank=rank, size=N, devices=D))
    mesh = local_mesh("d")
    spec_d = P("d")

    def step_fn(tx, nsteps=1, grow=False):
        # grow: step t's gradients are (t + 1) x the leaves; the wire's state is
        # a double-buffered transform's .wire
        def body(*leaves):
            g = [x[0] for x in leaves]
            st = tx.init(g)
            outs = []
            for t in range(nsteps):
                out, st = tx.update([y * (t + 1) for y in g] if grow else g, st)
                outs.append([y[None] for y in out])
            wire = getattr(st, "wire", st)
            return outs, [r[None] for r in wire.residual], wire.all_finite[None]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec_d, out_specs=spec_d))

    # -- bytes on the wire, from the timeline --
    B = 256
    n = N * B * 4
    wire = {}
    for name, q in [
        ("int8", jaxsync.Quantized(bits=8, block=B)),
        ("fp4", jaxsync.Quantized(bits=4, kind="float", block=B)),
    ]:
        tx = jaxsync.hierarchical_mean(axis_name="d", comm=comm, comm_dtype=q)
        f = step_fn(tx)
        x = jnp.asarray(np.sin(np.arange(D * n, dtype=np.float32)).reshape(D, n) * (rank + 1))
        d = os.path.join(ns.dir, name)
        with jaxsync.timeline(d):
            jax.block_until_ready(f(x))
        wire[name] = dict(n=n, bits=q.bits, block=B, dir=d)
    res.add("bytes", wire)

    # -- the property, every rank the same examples --
    done = []

    @settings(
        max_examples=5,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(examples(), st.sampled_from(["hierarchical", "two_dimensional"]))
    def prop(example, strategy):
        sizes, spec, special, seed = example
        vals = values(sizes, special, seed, N * D)
        mine = [
            jnp.asarray(np.stack([vals[D * rank + d][k] for d in range(D)]))
            for k in range(len(sizes))
        ]
        make = getattr(jaxsync, f"{strategy}_mean")
        tx = make(axis_name="d", comm=comm, comm_dtype=spec, check_finite=True)
        (out,), _, ok = step_fn(tx)(*mine)
        out = [np.asarray(y) for y in out]
        row = dict(example=repr(example), strategy=strategy, out=out, ok=np.asarray(ok))
        try:
            for y in out:
                assert (y.view(np.uint32) == y[:1].view(np.uint32)).all(), "replicas differ"
            plan = jaxsync.make_plan(list(vals[0]))
            check([y[0] for y in out], vals, plan, spec, N, D, strategy == "two_dimensional")
            finite = all(np.isfinite(v).all() for leaves in vals for v in leaves)
            assert (np.asarray(ok) == finite).all(), "all_finite"
            row["error"] = None
        except AssertionError:
            row["error"] = traceback.format_exc()
        done.append(row)

    prop()
    res.add("property", done)

    # -- error feedback over 3 steps --
    q = jaxsync.Quantized(bits=4, kind="int", block=8)
    tx = jaxsync.hierarchical_mean(axis_name="d", comm=comm, comm_dtype=q)
    x = jnp.asarray(np.cos(np.arange(D * 37, dtype=np.float32)).reshape(D, 37) * (rank + 1))
    outs, resid, _ = step_fn(tx, 3)(x)
    res.add("ef", dict(outs=to_numpy(outs), residual=to_numpy(resid)))
    # strategy="auto" with the same wire: the strategy it picks, bit for bit
    got = {}
    for name in ("auto", "two_dimensional"):
        make = getattr(jaxsync, f"{name}_mean")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no measured profile here
            outs, resid, _ = step_fn(make(axis_name="d", comm=comm, comm_dtype=q), 3)(x)
        got[name] = dict(outs=to_numpy(outs), residual=to_numpy(resid))
    res.add("auto", got)

    # -- sharded: the reduce-scatter quantized, nothing requantized --
    import optax
    from test_zero_quant import _reference, _tree

    def sharded_fn(q, check_finite=True):
        tx = jaxsync.sharded(
            optax.sgd(1.0), axis_name="d", comm=comm, comm_dtype=q, check_finite=check_finite
        )

        def body(*leaves):
            g = [x[0] for x in leaves]
            u, st = tx.update(g, tx.init(g), g)
            ok = st.all_finite if st.all_finite is not None else jnp.array(True)
            return [y[None] for y in u], [r[None] for r in st.residual], ok[None]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec_d, out_specs=spec_d))

    sh_bytes = {}
    K = 2 * B  # each replica's slice of one float32 leaf of N * D * K values
    for name, q in [
        ("int8", jaxsync.Quantized(bits=8, block=B)),
        ("fp4", jaxsync.Quantized(bits=4, kind="float", block=B)),
    ]:
        f = sharded_fn(q, check_finite=False)  # (its count would be one more allreduce)
        x = jnp.asarray(np.sin(np.arange(D * N * D * K, dtype=np.float32)).reshape(D, -1))
        d = os.path.join(ns.dir, "sharded_" + name)
        with jaxsync.timeline(d):
            jax.block_until_ready(f(x))
        sh_bytes[name] = dict(K=K, bits=q.bits, block=B, dir=d)
    sh_rows = []
    for q, special in [
        (jaxsync.Quantized(bits=8, kind="int", block=8), "none"),
        (jaxsync.Quantized(bits=4, kind="float", block=8, rounding="stochastic"), "nan"),
    ]:
        tree = _tree(N, D, seed=7, special=special)  # every rank the same values
        u, _, ok = sharded_fn(q)(*[x[rank] for x in tree])
        means, bounds, dirty = _reference(tree, N, D, q)
        row = dict(spec=repr(q), out=to_numpy(u), ok=np.asarray(ok))
        try:
            for i, y in enumerate(u):
                y = np.asarray(y, np.float32).reshape(D, -1)
                assert (y.view(np.uint32) == y[:1].view(np.uint32)).all(), "replicas differ"
                got = -y[0].astype(np.float64)
                bound = bounds[i] + (np.abs(means[i]) * 2.0**-8 if i == 4 else 0)
                assert (np.isnan(got) == dirty[i]).all(), f"NaN blocks of leaf {i}"
                err = np.abs(got - means[i])[~dirty[i]]
                assert (err <= bound[~dirty[i]]).all(), f"leaf {i} beyond its bound"
            assert (np.asarray(ok) == (special == "none")).all(), "all_finite"
            row["error"] = None
        except AssertionError:
            row["error"] = traceback.format_exc()
        sh_rows.append(row)
    res.add("sharded", dict(bytes=sh_bytes, rows=sh_rows))

    # -- overlap and double buffering: the schedule per bucket, on the lane --
    sizes = (37, 300, 5, 129)  # four leaves; overlap buckets of about 512 bytes
    xs = [
        jnp.asarray(np.sin(np.arange(D * m, dtype=np.float32) * (k + 1)).reshape(D, m) * (rank + 1))
        for k, m in enumerate(sizes)
    ]

    ov = {}
    for strategy in ("hierarchical", "two_dimensional"):
        make = getattr(jaxsync, f"{strategy}_mean")
        for name, q, kw in [
            ("plain", jaxsync.Quantized(bits=4, block=16, rounding="stochastic"), {}),
            (
                "overlap",
                jaxsync.Quantized(bits=4, block=16, rounding="stochastic"),
                dict(overlap=True, overlap_bucket_bytes=512),
            ),
            ("nearest", jaxsync.Quantized(bits=8, block=16), {}),
            ("double", jaxsync.Quantized(bits=8, block=16), dict(double_buffering=True)),
        ]:
            kw = {"overlap": False, "pack_threshold": 256, **kw}  # 3 buffers
            tx = make(axis_name="d", comm=comm, comm_dtype=q, **kw)
            f = step_fn(tx, 3, grow=True)
            d = os.path.join(ns.dir, f"ov_{strategy}_{name}")
            with jaxsync.timeline(d):
                outs, resid, _ = jax.block_until_ready(f(*xs))
            ov[f"{strategy}/{name}"] = dict(outs=to_numpy(outs), residual=to_numpy(resid), dir=d)
    res.add("overlap", ov)
    res.write()


if __name__ == "__main__":
    main()
