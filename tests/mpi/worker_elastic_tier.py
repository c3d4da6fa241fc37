"""The host tier's pipelined requests under in-process recovery (``-n 4``, ULFM).

    mpirun --with-ft ulfm -n 4 python worker_elastic_tier.py OUT_DIR

``JAXSYNC_TESTING_HOSTS=2``: ranks {0, 1} and {2, 3} are two hosts; after rank 3 is
lost, {0, 1} and {2}. ``hierarchical_mean(None, host_tier=True, reduce="sum")`` on a
2 MiB leaf (4 chunks of the tier's 512 KiB: its host and cross stages run
pipelined in one native call), one CPU device per process, plain jit. The gradient
of rank r at step t is ``(r + 1) * c(t)`` tiled (dyadic); rank 3 kills itself at
step 3; a commit per step. Each survivor writes OUT_DIR/rank-R.json: a digest of
the final parameters, whether the tier was used before and after, the exit drain.
"""

import json
import os
import signal
import sys

os.environ["JAXSYNC_TESTING_HOSTS"] = "2"
import jax

jax.config.update("jax_num_cpu_devices", 1)
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxsync
import jaxsync.elastic as el
from jaxsync._comm import _quiet

STEPS, KILL_AT, N = 6, 3, 1 << 19
out = sys.argv[1]
first = MPI.COMM_WORLD.Get_rank()
made = {}


def c(t):
    return jnp.tile(jnp.array([t + 1, 0.5, -(t % 3), 0.25], jnp.float32), N // 4)


def make(s):
    tx = jaxsync.hierarchical_mean(None, comm=s.comm, host_tier=True, reduce="sum")
    made.update(f=jax.jit(lambda w, g: w - 0.5 * tx.update(g, tx.init(g))[0]))
    from jaxsync._comm._topology import Comms

    made["comms"] = lambda: Comms._cache.get(id(s.comm))


state = el.State(w=np.zeros(N, np.float32), t=0)
make(state)
state.on_reset(make)
state.commit()
tiers = []


def train(s):
    while int(s.t) < STEPS:
        t = int(s.t)
        if t == KILL_AT and first == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        s.w = made["f"](s.w, (s.comm.Get_rank() + 1) * c(t))
        s.t = t + 1
        s.commit()
        cm = made["comms"]()
        tiers.append(None if cm is None or cm._tier is None else cm._tier.hosts)
    return np.asarray(s.w)


w = el.run(train, state)
quiet = _quiet.wait_until_quiet(limit_s=10.0)
jaxsync.free_communicators()
rec = {
    "head": w[:4].tolist(),
    "same": bool((w.reshape(-1, 4) == w[:4]).all()),
    "tiers": tiers,
    "quiet": quiet,
    "size": state.comm.Get_size(),
    "recoveries": state.recoveries,
    "restored": state.last_recovery.get("restored_commit"),
}
with open(os.path.join(out, f"rank-{first}.json"), "w") as f:
    json.dump(rec, f)
state.comm.Barrier()
sys.stdout.flush()
os._exit(0)
