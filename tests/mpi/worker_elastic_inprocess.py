"""In-process recovery (jaxsync.elastic.run) under ``mpirun --with-ft ulfm -n 3``.

    mpirun --with-ft ulfm -n 3 python worker_elastic_inprocess.py OUT_DIR [MODE]

Each process has one CPU device. Four models train in one step: ``w`` with
``jaxsync.naive_mean(comm="auto")`` (a stall watchdog on, ``on_timeout="abort"``:
it must not end the job during the recovery), and ``p`` with
``jaxsync.sharded(optax.sgd(0.5, momentum=0.5), comm="auto")`` (each rank holds a
third of the momentum; ``State(sharded=...)`` keeps a ring copy), and ``q`` (4
leaves) with ``naive_mean(overlap=True)``, a bucket per leaf, and ``d`` with
``naive_mean(double_buffering=True)`` (step t averages and applies step t - 1's
gradients, each rank's own, pending in the committed state). The gradient of rank r
at step t is ``(r + 1) * c(t)`` (dyadic; leaf j of ``q``: times j + 1, tiled); a
commit after every step. At the end, the exit drain and ``free_communicators`` are
timed (no MPI_Finalize: after a failure it can hang). The
transforms are made in the reset callback with ``comm="auto"``: after a recovery
they must run on the survivors (jaxsync's current world).

MODE ``one`` (default): rank 2 kills itself (SIGKILL) when it reaches step
``KILL_AT`` (progress, not the clock), in flight with the others' step; ranks 0 and
1 recover and finish. MODE ``two``: rank 2 kills itself inside the commit after step
``KILL_AT`` (before its ring copy: rank 0, whose copy it owed, stays a commit behind,
so step ``KILL_AT`` is redone), and rank 1 inside its first reset callback (a
process lost during the recovery): rank 0 recovers a second time and finishes alone.
MODE ``pair``: ranks 1 and 2 (ring neighbours) kill themselves at step ``KILL_AT``:
rank 1's slices are lost, and rank 0 must end with ``SlicesLost``, naming them. Each
survivor writes OUT_DIR/rank-R.json: final w, p, what ``topology()`` and
``broadcast_params`` (both ``comm="auto"``) saw after the recovery, the recoveries.
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
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync
import jaxsync.elastic as el
from jaxsync._comm import _quiet

STEPS, KILL_AT, LR = 6, 3, 0.5
out = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "one"
mesh = Mesh(np.array(jax.devices()), ("d",))
first = MPI.COMM_WORLD.Get_rank()
victim = MPI.COMM_WORLD.Get_size() - 1
inner = optax.sgd(0.5, momentum=0.5)


def c(t):
    return jnp.array([[t + 1, 0.5, -(t % 3), 0.25]], dtype=jnp.float32)


def cp(t):  # the sharded model's gradient: 6 entries, 2 per rank's slice on 3 ranks
    return jnp.array([t + 1, 0.5, -(t % 3), 0.25, 2.0 - t, 0.75], dtype=jnp.float32)


p0 = np.zeros((6,), np.float32)
step_fn = {}
seen = {}


def _make(s=None):
    if s is not None and mode == "two" and first == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # lost during the recovery
    if s is not None:  # comm="auto" follows the survivors
        top = jaxsync.topology()
        seen["topology"] = [top.rank, top.size]
        seen["broadcast"] = float(jaxsync.broadcast_params({"x": jnp.float32(first)})["x"])
    tx = jaxsync.naive_mean(axis_name="d", timeout=20.0, on_timeout="abort")
    ox = jaxsync.naive_mean(axis_name="d", overlap=True, overlap_bucket_bytes=256)
    zx = jaxsync.sharded(inner, axis_name="d")
    dx = jaxsync.naive_mean(axis_name="d", double_buffering=True)
    specs = jaxsync.state_specs(jax.eval_shape(zx.init, p0), "d")
    dspec = jax.tree.map(lambda _: P("d"), jax.eval_shape(dx.init, jnp.zeros((1, 4))))

    def both(w, g, p, gp, st, q, gq, d, ds):
        u, st = zx.update(gp, st, p)
        mq = ox.update(gq, ox.init(gq))[0]
        q = [a - LR * b for a, b in zip(q, mq)]
        md, ds = dx.update(g, ds)  # step t - 1's mean (the pending one), t's kept
        w = w - LR * tx.update(g, tx.init(g))[0]
        return w, optax.apply_updates(p, u), st, q, d - LR * md, ds

    f = jax.shard_map(
        both,
        mesh=mesh,
        in_specs=(P("d"), P("d"), P(), P(), specs, P("d"), P("d"), P("d"), dspec),
        out_specs=(P("d"), P(), specs, P("d"), P("d"), dspec),
    )
    init = jax.jit(jax.shard_map(zx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    dinit = jax.jit(jax.shard_map(dx.init, mesh=mesh, in_specs=P("d"), out_specs=dspec))
    step_fn.update(f=jax.jit(f), init=init, dinit=dinit)


_make()
state = el.State(
    w=np.zeros((1, 4), np.float32),
    t=0,
    p=p0,
    q=[np.zeros((1, 64), np.float32) for _ in range(4)],
    opt=step_fn["init"](jnp.asarray(p0)),
    d=np.zeros((1, 4), np.float32),
    ds=step_fn["dinit"](jnp.zeros((1, 4), jnp.float32)),
    sharded={"opt": (inner, "p")},
)
state.on_reset(_make)
state.commit()

if mode == "two" and first == victim:  # lost inside the commit after step KILL_AT
    _ring_copy = el._shards.ring_copy

    def _dies_in_commit(comm, parts):
        if int(state.t) == KILL_AT + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return _ring_copy(comm, parts)

    el._shards.ring_copy = _dies_in_commit

times = {}


def train(s):
    if s.recoveries:  # how long the failed step waited before it raised
        times["failed_after"] = times["failed"] - times["t0"]
    while int(s.t) < STEPS:
        t = int(s.t)
        if t == KILL_AT and (first == victim and mode == "one" or first and mode == "pair"):
            os.kill(os.getpid(), signal.SIGKILL)
        k = s.comm.Get_rank() + 1
        times["t0"] = time.perf_counter()
        try:
            gq = [k * (j + 1) * jnp.tile(c(t), (1, 16)) for j in range(4)]
            w, p, opt, q, d, ds = step_fn["f"](
                s.w, k * c(t), s.p, k * cp(t), s.opt, s.q, gq, s.d, s.ds
            )
            s.w, s.p, s.opt, s.q, s.d, s.ds, s.t = w, p, opt, q, d, ds, t + 1
            s.commit()  # blocks: a failure in the step surfaces here at the latest
        except Exception:
            times["failed"] = time.perf_counter()
            times.setdefault("held_at_failure", [n for n, _, _ in s._commits])
            raise
        if s.recoveries and "first_step_after" not in times:
            times["first_step_after"] = time.perf_counter() - times["failed"]
    return np.asarray(s.w), np.asarray(s.p), [np.asarray(x) for x in s.q], np.asarray(s.d)


try:
    w, p, q, d = el.run(train, state)
except el.SlicesLost as e:  # mode "pair": two ring neighbours lost together
    with open(os.path.join(out, f"rank-{first}.json"), "w") as f:
        json.dump({"error": str(e), "recoveries": state.recoveries}, f)
    sys.stdout.flush()
    os._exit(0)
# The exit drain and free (what the interpreter's exit runs before MPI_Finalize)
# must not wait on the revoked world's work: timed, and whether it went quiet.
t0 = time.perf_counter()
quiet = _quiet.wait_until_quiet(limit_s=10.0)
jaxsync.free_communicators()
times["exit_drain"] = time.perf_counter() - t0
rec = {
    "w": w.tolist(),
    "p": p.tolist(),
    "q": [x.tolist() for x in q],
    "d": d.tolist(),
    "quiet": quiet,
    "rank": state.comm.Get_rank(),
    "size": state.comm.Get_size(),
    "recoveries": state.recoveries,
    "commits": state.commits,
    "seen": seen,
    "recovery_s": state.last_recovery,
    "times_s": times,
}
with open(os.path.join(out, f"rank-{first}.json"), "w") as f:
    json.dump(rec, f)
state.comm.Barrier()
sys.stdout.flush()
os._exit(0)  # no MPI_Finalize after a failure (it can hang), nor jaxsync's exit drain
