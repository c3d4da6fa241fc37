"""A quantized wire through the host tier, blocking, overlapped and double-buffered.

Run as 4 processes faked into 2 hosts x 2 (``JAXSYNC_TESTING_HOSTS=2``), one device
each: ``hierarchical_mean(comm_dtype=Quantized(...))`` takes the host tier (on for a
quantized wire): each host's float32 reduce, the leaders' quantized all-to-all and
all-gather, the host's broadcast. Three steps of a three-buffer tree, per case:
``plain`` (``overlap=False``), ``overlap`` (``overlap=True``, buckets of 512 bytes:
the host tier's blocking calls and the leaders' calls on the lane, per bucket),
``default`` (the options' defaults: overlap on, the sync spans hosts), ``nearest`` /
``double`` (``double_buffering=True``); the outputs and the residuals, and the kinds
of the calls the overlapped step made (timeline).
"""

import json
import os

from _worker import Results, init, to_numpy


def main():
    ns, jax, MPI = init()
    os.environ["JAXSYNC_TESTING_HOSTS"] = "2"  # before jaxsync reads the topology
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    xs = [
        jnp.asarray(np.sin(np.arange(m, dtype=np.float32) * (k + 1))[None] * (rank + 1))
        for k, m in enumerate((37, 300, 129))
    ]

    def run(tx):
        def body(*leaves):
            g = [x[0] for x in leaves]
            st = tx.init(g)
            outs = []
            for t in range(3):
                out, st = tx.update([y * (t + 1) for y in g], st)
                outs.append([y[None] for y in out])
            wire = getattr(st, "wire", st)
            return outs, [r[None] for r in wire.residual]

        f = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        return jax.block_until_ready(jax.jit(f)(*xs))

    stochastic = jaxsync.Quantized(bits=4, block=16, rounding="stochastic")
    nearest = jaxsync.Quantized(bits=8, block=16)
    got = {}
    for name, q, kw in [
        ("plain", stochastic, dict(overlap=False)),
        ("overlap", stochastic, dict(overlap=True, overlap_bucket_bytes=512)),
        ("default", stochastic, {}),
        ("nearest", nearest, dict(overlap=False)),
        ("double", nearest, dict(overlap=False, double_buffering=True)),
    ]:
        tx = jaxsync.hierarchical_mean("d", comm, comm_dtype=q, pack_threshold=256, **kw)
        d = os.path.join(ns.out, f"timeline-{name}")
        with jaxsync.timeline(d):
            outs, resid = run(tx)
        with open(os.path.join(d, f"rank{rank}.json")) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        kinds = sorted({e["name"] for e in events if e.get("cat") == "communication"})
        got[name] = dict(outs=to_numpy(outs), residual=to_numpy(resid), kinds=kinds)
    res.add("cases", got)
    res.write()


if __name__ == "__main__":
    main()
