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
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _worker import Results, init, to_numpy  # noqa: E402


def main():
    ns, jax, MPI = init([(("--dir",), dict(required=True))])
    import jax.numpy as jnp
    import numpy as np
    from _quant_ref import check, examples, values
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank, N = comm.Get_rank(), comm.Get_size()
    D = jax.local_device_count()
    res = Results(ns.out, rank)
    res.add("meta", dict(rank=rank, size=N, devices=D))
    mesh = Mesh(np.array(jax.devices()), ("d",))
    spec_d = P("d")

    def step_fn(tx, nsteps=1):
        def body(*leaves):
            g = [x[0] for x in leaves]
            st = tx.init(g)
            outs = []
            for _ in range(nsteps):
                out, st = tx.update(g, st)
                outs.append([y[None] for y in out])
            return outs, [r[None] for r in st.residual], st.all_finite[None]

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
    res.write()


if __name__ == "__main__":
    main()
