"""Worker: row-sparse sync over jax.distributed (gloo), comm=AxisComm("host").

Run as ``python worker_sparse_axis.py PROCESS_ID PORT RESULTS`` twice (2 processes x 2
devices, 4 replicas). Replica ``r`` holds rows ``[r, r+1, r]`` (a duplicate)
of a 16 x 2 table with values ``r + 1``; writes the synced ``todense()``
per option as JSON lines to the file RESULTS.
"""

import json

from _runtime import join, replicas

jax, pid, results = join()
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsync  # noqa: E402

V = 64
mesh, r = replicas(np.int32)
for name, opts in (
    ("sparse", jaxsync.SparseOptions(mode="sparse")),
    ("coalesce", jaxsync.SparseOptions(mode="sparse", coalesce=True)),
    ("densify", jaxsync.SparseOptions(mode="sparse", densify=True)),
):
    tx = jaxsync.hierarchical_mean(axis_name="local", comm=jaxsync.AxisComm("host"), sparse=opts)

    def f(r):
        i = r[0]
        g = jaxsync.RowSparse(
            jnp.stack([i, i + 1, i]), jnp.ones((3, 2), jnp.float32) * (i + 1).astype(jnp.float32), V
        )
        out = tx.update(
            {"e": g, "w": jnp.ones(2) * i.astype(jnp.float32)}, tx.init({"e": g, "w": jnp.ones(2)})
        )[0]
        e = out["e"]
        return (e.todense() if isinstance(e, jaxsync.RowSparse) else e), out["w"]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("host", "local")), out_specs=P()))
    d, w = g(r)
    print(
        json.dumps(
            {
                "pid": pid,
                "case": name,
                "dense": np.asarray(d.addressable_data(0)).tolist(),
                "w": np.asarray(w.addressable_data(0)).tolist(),
            }
        ),
        file=results,
        flush=True,
    )
