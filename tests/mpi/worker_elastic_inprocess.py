"""In-process recovery (prototype, jaxsync.elastic.run) under ``mpirun --with-ft ulfm``.

    mpirun --with-ft ulfm -n 3 python worker_elastic_inprocess.py OUT_DIR

Each process has one CPU device; the gradient of rank r at step t is
``(r + 1) * c(t)`` (dyadic) and ``jaxsync.naive_mean(comm=state.comm)`` averages it;
``w -= 0.5 * mean``; a commit after every step. Rank ``size - 1`` kills itself
(SIGKILL) when it reaches step ``KILL_AT`` (progress, not the clock). The survivors
recover (revoke, shrink, restore the agreed commit, new transform) and finish; each
writes OUT_DIR/rank-R.json: final w, its rank and size after, the recoveries.
"""

import json
import os
import signal
import sys
import time

import jax
from mpi4py import MPI

jax.config.update("jax_num_cpu_devices", 1)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync
import jaxsync.elastic as el

STEPS, KILL_AT, LR = 6, 3, 0.5
out = sys.argv[1]
mesh = Mesh(np.array(jax.devices()), ("d",))
first = MPI.COMM_WORLD.Get_rank()
victim = MPI.COMM_WORLD.Get_size() - 1


def c(t):
    return jnp.array([[t + 1, 0.5, -(t % 3), 0.25]], dtype=jnp.float32)


state = el.State(MPI.COMM_WORLD, w=np.zeros((1, 4), np.float32), t=0)
step_fn = {}
state.on_reset(lambda s: step_fn.update(f=_make(s)))


def _make(s):
    tx = jaxsync.naive_mean(axis_name="d", comm=s.comm)
    mean = jax.shard_map(
        lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P("d"), out_specs=P("d")
    )
    return jax.jit(lambda w, g: w - LR * mean(g))


step_fn["f"] = _make(state)
state.commit()


times = {}


def train(s):
    if s.recoveries:  # how long the failed step waited before it raised
        times["failed_after"] = times["failed"] - times["t0"]
    while int(s.t) < STEPS:
        t = int(s.t)
        if first == victim and t == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        g = (s.comm.Get_rank() + 1) * c(t)
        times["t0"] = time.perf_counter()
        try:
            s.w = step_fn["f"](jnp.asarray(s.w), g)
            s.t = t + 1
            s.commit()  # blocks: a failure in the step surfaces here at the latest
        except Exception:
            times["failed"] = time.perf_counter()
            raise
        if s.recoveries and "first_step_after" not in times:
            times["first_step_after"] = time.perf_counter() - times["failed"]
    return np.asarray(s.w)


w = el.run(train, state)
rec = {
    "w": w.tolist(),
    "rank": state.comm.Get_rank(),
    "size": state.comm.Get_size(),
    "recoveries": state.recoveries,
    "commits": state.commits,
    "recovery_s": state.last_recovery,
    "times_s": times,
}
with open(os.path.join(out, f"rank-{first}.json"), "w") as f:
    json.dump(rec, f)
state.comm.Barrier()
sys.stdout.flush()
os._exit(0)  # no MPI_Finalize after a failure (it can hang), nor jaxsync's exit drain
