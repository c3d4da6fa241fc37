"""Process death and exit (rows 9 and 11, tests/_common.py).

Modes:
  die_before_sync   rank 1 exits with code 3 (os._exit: no MPI_Finalize) before
                    its first sync, once rank 0 has called a jitted sync (rank 0
                    blocks in the trace-time agreement exchange).
  die_after_compile both ranks trace and compile the sync; rank 1 exits with
                    code 3; rank 0 runs the compiled step and blocks inside the
                    compiled MPI collective.
  exit_after_async  both ranks dispatch several chained jitted syncs and return
                    from main without blocking on the results: a clean exit.

In both "die" modes rank 1 waits for rank 0's "calling" marker file before it
exits, so rank 0 is inside the sync when the job loses rank 1.

Each rank writes marker files (``rank{R}.{what}``) next to its results so the
test can tell how far it got.
"""

import os
import time

from _worker import init


def main():
    ns, jax, MPI = init([(("--mode",), dict(required=True))])
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    D = jax.local_device_count()

    def mark(what):
        with open(os.path.join(ns.out, f"rank{rank}.{what}"), "w") as f:
            f.write(what)

    def die_once_rank0_waits():
        """Rank 1: exit (code 3, no MPI_Finalize) once rank 0 is in its sync.

        Waits on rank 0's marker file (not on MPI), so rank 0 is certain to have
        entered the sync when the job loses rank 1.
        """
        marker = os.path.join(ns.out, "rank0.calling")
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        mark("exiting" if os.path.exists(marker) else "exiting-without-rank0")
        os._exit(3)

    mesh = Mesh(np.array(jax.devices()), ("d",))
    tx = jaxsync.hierarchical_mean(axis_name="d", comm=comm)
    step = jax.jit(
        jax.shard_map(
            lambda t: tx.update(t, tx.init(t))[0], mesh=mesh, in_specs=P("d"), out_specs=P("d")
        )
    )
    x = jax.device_put({"w": jnp.full((D, 1000), float(rank))}, NamedSharding(mesh, P("d")))
    mark("started")

    if ns.mode == "die_before_sync":
        if rank == 1:
            die_once_rank0_waits()
        mark("calling")
        jax.block_until_ready(step(x))
        mark("returned")  # must not happen: rank 1 is gone
    elif ns.mode == "die_after_compile":
        compiled = step.lower(x).compile()
        comm.Barrier()
        if rank == 1:
            die_once_rank0_waits()
        mark("calling")
        jax.block_until_ready(compiled(x))
        mark("returned")
    elif ns.mode == "exit_after_async":
        for _ in range(5):
            x = step(x)  # chained through x; never blocked on
        mark("dispatched")
        # Falls off the end: atexit drains the steps before MPI_Finalize.
    else:
        raise SystemExit(f"unknown mode {ns.mode}")


if __name__ == "__main__":
    main()
