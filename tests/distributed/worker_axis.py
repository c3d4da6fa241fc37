"""Worker: jaxsync over JAX's own multi-process runtime (jax.distributed + gloo).

Run as ``python worker_axis.py PROCESS_ID PORT RESULTS`` twice; writes one JSON
line of results per strategy to the file RESULTS.
"""

import json

from _runtime import join, replicas

jax, pid, results = join()
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsync  # noqa: E402

mesh, r = replicas(np.float32)
for strategy in ["naive", "flat", "hierarchical", "two_dimensional"]:
    tx = getattr(jaxsync, strategy + "_mean")(axis_name="local", comm=jaxsync.AxisComm("host"))

    def f(r):
        # replica r holds leaf k filled with r + k
        t = {"a": jnp.full((5,), r[0]), "b": jnp.full((3,), r[0] + 1, jnp.bfloat16)}
        return tx.update(t, tx.init(t))[0]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("host", "local")), out_specs=P()))
    out = g(r)
    print(
        json.dumps(
            {
                "pid": pid,
                "strategy": strategy,
                "a": np.asarray(out["a"].addressable_data(0)).tolist(),
                "b": np.asarray(out["b"].addressable_data(0)).astype(float).tolist(),
                "b_dtype": str(out["b"].dtype),
            }
        ),
        file=results,
        flush=True,
    )
p = jaxsync.broadcast_params({"w": jnp.full((3,), float(pid) + 7)}, comm=jaxsync.AxisComm("host"))
print(
    json.dumps({"pid": pid, "strategy": "broadcast", "w": np.asarray(p["w"]).tolist()}),
    file=results,
    flush=True,
)
# local_batch: a global batch of 8 rows, on the global mesh (each device its rows)
# and on this process's own devices (its rows from jax.distributed's index and count).
x = np.arange(8.0, dtype=np.float32)
local_mesh = Mesh(np.array(jax.local_devices()), ("local",))
rows = {
    "global": jaxsync.local_batch({"x": x}, mesh)["x"],
    "local": jaxsync.local_batch({"x": x}, local_mesh, comm=None)["x"],
}
print(
    json.dumps(
        {
            "pid": pid,
            "strategy": "local_batch",
            **{
                k: [np.asarray(s.data).tolist() for s in v.addressable_shards]
                for k, v in rows.items()
            },
            "global_shape": list(rows["global"].shape),
        }
    ),
    file=results,
    flush=True,
)
