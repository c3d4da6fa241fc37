"""Local updates under in-process recovery (``mpirun --with-ft ulfm -n 3``).

    mpirun --with-ft ulfm -n 3 python worker_elastic_local.py OUT_DIR MODE

One island per process (``jaxsync.islands("process")``), one CPU device each, inner
``optax.sgd(0.5)``, outer ``optax.sgd(0.5, momentum=0.5)``, ``every=4``. The gradient
of rank r at step t is ``(r + 1) * c(t)`` (dyadic). The ``LocalUpdatesState`` is an
entry of ``State``, committed after every step (MODE ``stream``: every step with no
transfer in flight, i.e. not right after a send step: a handle names the old world's
lane, which a recovery fails). Survivors make the transform on the shrunk world in
the reset callback.

MODE ``diloco``: rank 2 is killed at step 5 (mid-interval); the survivors raise in
step 5 (here, each run) or at the latest in the outer mean of step 7. MODE
``stream``: ``diloco(delay=1, mix=0.5, overlap=True)``; rank 2 is killed at step 7,
the survivors send their pseudo-gradients on the lane (in flight), and the step that
awaits it (8) fails: the recovery fails the old lane, the survivors restore the
commit of step 6 and redo 7 and 8 on a new lane. MODE ``sent``: as ``stream``, but
a commit after every step, also right after a send step (it waits for the sum in
flight and keeps it), and rank 2 is killed at step 4, just after that commit: the
survivors restore it, its 3-island mean back in flight, and apply it at step 5
(``jaxsync.local.resume_in_flight``). Each survivor writes
OUT_DIR/rank-R.json: final parameters, anchor, the recovery and whether the exit
drain went quiet.
"""

import json
import os
import signal
import sys

import jax

jax.config.update("jax_num_cpu_devices", 1)
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import jaxsync
import jaxsync.elastic as el
from jaxsync._comm import _quiet

STEPS = 10
out, mode = sys.argv[1], sys.argv[2]
KILL_AT = {"diloco": 5, "stream": 7, "sent": 4}[mode]
first = MPI.COMM_WORLD.Get_rank()
victim = MPI.COMM_WORLD.Get_size() - 1
made = {}


def c(t):
    return jnp.array([t + 1, 0.5, -(t % 3), 0.25], dtype=jnp.float32)


def make(s):
    isl = jaxsync.islands("process", comm=s.comm)
    extra = {"delay": 1, "mix": 0.5, "overlap": True} if mode != "diloco" else {}
    tx = jaxsync.diloco(optax.sgd(0.5), optax.sgd(0.5, momentum=0.5), every=4, islands=isl, **extra)

    def step(x, opt, g):
        u, opt = tx.update(g, opt, x)
        return optax.apply_updates(x, u), opt

    made.update(tx=tx, f=jax.jit(step), islands=isl.count)


x0 = np.zeros((4,), np.float32)
state = el.State(x=x0, t=0, opt=None)
make(state)
state.opt = made["tx"].init(jnp.asarray(x0))
state.on_reset(make)
state.commit()


def train(s):
    while int(s.t) < STEPS:
        t = int(s.t)
        if t == KILL_AT and first == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        k = s.comm.Get_rank() + 1
        x, opt = made["f"](s.x, s.opt, k * c(t))
        s.x, s.opt, s.t = x, opt, t + 1
        jax.block_until_ready((x, opt))  # a failure in the step surfaces here
        if mode != "stream" or (t + 1) % 4:  # stream: not right after a send step
            s.commit()  # sent: every step (the sum in flight is waited for and kept)
    return np.asarray(s.x), np.asarray(s.opt.anchor)


x, anchor = el.run(train, state)
quiet = _quiet.wait_until_quiet(limit_s=10.0)
jaxsync.free_communicators()
rec = {
    "x": x.tolist(),
    "anchor": anchor.tolist(),
    "quiet": quiet,
    "rank": state.comm.Get_rank(),
    "size": state.comm.Get_size(),
    "islands": made["islands"],
    "recoveries": state.recoveries,
    "recovery_s": state.last_recovery,
}
with open(os.path.join(out, f"rank-{first}.json"), "w") as f:
    json.dump(rec, f)
state.comm.Barrier()
sys.stdout.flush()
os._exit(0)  # no MPI_Finalize after a failure (it can hang)
