"""A short data-parallel run under srun, exact, with a checkpoint (and a lost rank).

    srun -n 2 --mpi=pmi2 python worker_train.py DIR [--kill-at K | --lose-at K]
    python -m jaxsync elastic --mpirun srun ... -- python worker_train.py DIR --kill-at K

``optax.chain(jaxsync.hierarchical_mean(axis_name=None), optax.sgd(LR))``, jit-compiled,
one device per process, ``comm="auto"`` (MPI.COMM_WORLD under srun). The loss is
``<w, (rank + 1) * c(t)>``, so rank r's gradient at step t is ``(r + 1) * c(t)``:
small dyadic values, so every sum, mean and update is exact in float32 and the result
has a closed form. Rank 0 checkpoints after every step (written whole, then renamed)
and a barrier follows. With ``--kill-at K``, on the supervisor's first run
(``jaxsync.elastic.world().restart == 0``) the last rank kills itself (SIGKILL) when it
reaches step K - by the program's progress, not the clock. With ``--lose-at K`` (on
the emulated cluster, worker_cluster.py), in the run that starts from scratch (no
checkpoint yet: a run whose MPI failed to start counts for nothing), the last rank
instead marks ``lose`` there (``jaxsync.cluster.mark``: the cluster then loses its host
whole, slurmd and all) and waits to be killed with it. Rank 0 appends each run's
(restart, np, first step) to DIR/runs.jsonl; every rank writes DIR/final-rank{R}.npy
(its parameters) at the end.
"""

import argparse
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsync
import jaxsync.elastic as el

STEPS, LR = 8, 0.5


def c(t):
    return np.array([t + 1, 0.5, -(t % 3), 0.25], dtype=np.float32)


p = argparse.ArgumentParser()
p.add_argument("folder")
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--lose-at", type=int, default=-1)
ns = p.parse_args()
me = el.world()
comm = jaxsync.default_comm()  # None when one process is left
rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
if me.supervised:
    assert me.np == size, (me, size)
ckpt = os.path.join(ns.folder, "ckpt.npz")
w, start = np.zeros(4, np.float32), 0
if os.path.exists(ckpt):  # resume: the checkpoint is the anchor
    with np.load(ckpt) as z:
        w, start = z["w"].copy(), int(z["step"])
if rank == 0:
    with open(os.path.join(ns.folder, "runs.jsonl"), "a") as f:
        f.write(json.dumps({"restart": me.restart, "np": size, "start": start}) + "\n")

tx = optax.chain(jaxsync.hierarchical_mean(axis_name=None), optax.sgd(LR))
params = {"w": jnp.asarray(w)}
opt_state = tx.init(params)


@jax.jit
def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.vdot(p["w"], x))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


for t in range(start, STEPS):
    if me.restart == 0 and rank == size - 1 and size > 1 and t == ns.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if start == 0 and rank == size - 1 and size > 1 and t == ns.lose_at:
        import jaxsync.cluster

        jaxsync.cluster.mark("lose")
        time.sleep(600)  # killed with its host (the run's time limit is far shorter)
    params, opt_state = step(params, opt_state, jnp.asarray((rank + 1) * c(t)))
    if rank == 0:
        with open(ckpt + ".tmp", "wb") as f:
            np.savez(f, w=np.asarray(params["w"]), step=t + 1)
        os.replace(ckpt + ".tmp", ckpt)
    if comm is not None:
        comm.Barrier()
np.save(os.path.join(ns.folder, f"final-rank{rank}.npy"), np.asarray(params["w"]))
