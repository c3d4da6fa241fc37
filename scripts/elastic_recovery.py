"""How long an in-process recovery takes (ULFM): from a lost process to the next step.

Run in the ft environment (``bash scripts/setup_ft.sh``), from the checkout:

    .venv-ft/bin/mpirun --with-ft ulfm --allow-run-as-root --oversubscribe -n 4 \\
        .venv-ft/bin/python scripts/elastic_recovery.py [--steps 6] [--kill-at 3]

Across the emulated cluster's hosts (each its own daemon, so pass ``--stamp`` a path
on the shared filesystem) see docs/benchmarks.md.

Each process drives one CPU device and trains the benchmark's ResNet-like tree
(``jaxsync.bench.trees.resnet18_like``: 47 leaves, 5.5M float32) with
``jaxsync.sharded(optax.sgd(momentum=0.5), comm="auto")``, made (and compiled ahead
of time) in the reset callback, and ``jaxsync.elastic.State(sharded=...)``, a commit
after every step. The last rank kills itself (SIGKILL) when it reaches step
``--kill-at``, writing the time first (the processes share one clock). Rank 0 prints
one JSON line: the step and commit times before the loss, and the recovery split into
detection (the kill to the failed step's error), revoke, shrink, agree, restore
(sharded state rebuilt from the ring copies and cut for the survivors), reset (new
transforms on the shrunk world), re-jit (the step compiled again) and the first
step after the recovery; and the steps lost (since the agreed commit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jaxsync
import jaxsync.elastic as el
from jaxsync.bench.trees import resnet18_like


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill-at", type=int, default=3)
    ap.add_argument(
        "--stamp",
        default=None,
        help="the file the lost rank writes its kill time to, read by rank 0 (default: "
        "in $TMPDIR, named by the parent's PID: give one across hosts, whose daemons differ)",
    )
    ns = ap.parse_args()
    jax.config.update("jax_num_cpu_devices", 1)  # before the backend starts
    world = MPI.COMM_WORLD
    first, n0 = world.Get_rank(), world.Get_size()
    stamp = ns.stamp or os.path.join(tempfile.gettempdir(), f"jaxsync-elastic-kill-{os.getppid()}")
    if first == 0 and os.path.exists(stamp):
        os.remove(stamp)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    inner = optax.sgd(2.0**-4, momentum=0.5)
    p0 = jax.tree.map(lambda s: np.full(s.shape, 0.5, np.float32), resnet18_like())
    fns: dict = {}

    def make(s=None) -> None:
        t0 = time.perf_counter()
        zx = jaxsync.sharded(inner, axis_name="d")
        specs = jaxsync.state_specs(jax.eval_shape(zx.init, p0), "d")

        def step(p, st, k):
            g = jax.tree.map(lambda x: jnp.full_like(x, k * 2.0**-10), p)
            u, st = zx.update(g, st, p)
            return optax.apply_updates(p, u), st

        f = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs))
        )
        t1 = time.perf_counter()
        if s is None:
            init = jax.shard_map(zx.init, mesh=mesh, in_specs=P(), out_specs=specs)
            fns["init"] = jax.jit(init)(p0)
        shapes = (p0, jax.eval_shape(zx.init, p0), jnp.float32(1.0))
        fns["step"] = f.lower(*shapes).compile()  # the re-jit, timed on its own
        fns["transforms_s"], fns["compile_s"] = t1 - t0, time.perf_counter() - t1

    make()
    state = el.State(p=p0, opt=fns.pop("init"), t=0, sharded={"opt": (inner, "p")})
    state.on_reset(make)
    state.commit()
    out: dict = {"processes": n0, "tree": "resnet18_like (47 leaves, 5.5M float32)"}
    marks: dict = {}

    def train(s):
        while int(s.t) < ns.steps:
            t = int(s.t)
            if first == n0 - 1 and t == ns.kill_at:
                with open(stamp, "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            k = jnp.float32(s.comm.Get_rank() + 1)
            a = time.perf_counter()
            try:
                p, opt = fns["step"](s.p, s.opt, k)
                jax.block_until_ready((p, opt))
            except Exception:
                marks["failed"], marks["t_failed"] = time.time(), t
                raise
            b = time.perf_counter()
            s.p, s.opt, s.t = p, opt, t + 1
            s.commit()
            c = time.perf_counter()
            if s.recoveries and "first_step_s" not in marks:
                marks["first_step_s"] = b - a
            elif not s.recoveries and t > 0:
                marks.setdefault("step_s", []).append(b - a)
                marks.setdefault("commit_s", []).append(c - b)
        return s

    el.run(train, state)
    if state.comm.Get_rank() == 0:
        with open(stamp) as fh:
            killed = float(fh.read())
        rec = state.last_recovery
        parts = {"detection": marks["failed"] - killed}
        parts.update({k: rec[k] for k in ("revoke", "shrink", "agree", "restore")})
        parts["reset"] = fns["transforms_s"]
        parts["re-jit"] = fns["compile_s"]
        parts["first step"] = marks["first_step_s"]
        out["survivors"] = state.comm.Get_size() if state.comm is not None else 1
        out["step_s"] = float(np.median(marks["step_s"]))
        out["commit_s"] = float(np.median(marks["commit_s"]))
        out["recovery_s"] = parts
        out["total_s"] = sum(parts.values())
        out["load_average_1min"] = os.getloadavg()[0]
        out["cpus"] = os.cpu_count()
        out["steps_lost"] = marks["t_failed"] - (rec["restored_commit"] - 1)
        print(json.dumps(out), flush=True)
        os.remove(stamp)
    state.comm.Barrier()
    sys.stdout.flush()
    os._exit(0)  # no MPI_Finalize after a failure (it can hang)


if __name__ == "__main__":
    main()
