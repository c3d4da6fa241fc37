"""A rank that stops calling, under the stall watchdog (issue 27).

Every rank runs ``--steps`` jitted steps of one synchronisation made with
``timeout=--timeout, on_timeout=--on-timeout``; rank 1 sleeps ``--sleep``
seconds (in Python, outside jaxsync) before step ``--stall-step`` (0: before
the first, so the others wait in the first execution: the agreement), or
stops itself (``--how stop``: SIGSTOP, a peer that never answers again, as
behind a cut link) or kills itself (``--how die``: SIGKILL). Each
rank writes a marker ``rank{R}.step{S}`` before each step and records every
step's result; with ``on_timeout="abort"`` and a long sleep the job must end
(non-zero) before any rank writes its results.
"""

import os
import signal
import time

from _worker import Results, init, to_numpy


def main():
    ns, jax, MPI = init(
        [
            (("--steps",), dict(type=int, default=3)),
            (("--stall-step",), dict(type=int, default=1)),
            (("--sleep",), dict(type=float, default=0.0)),
            (("--timeout",), dict(type=float, default=2.0)),
            (("--on-timeout",), dict(default="report")),
            (("--strategy",), dict(default="hierarchical")),
            (("--staging",), dict(default="device")),
            (("--how",), dict(default="sleep", choices=("sleep", "stop", "die"))),
        ]
    )
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    d = jax.local_device_count()
    # on_timeout="report" is the default: not passed, as before it existed.
    action = {} if ns.on_timeout == "report" else dict(on_timeout=ns.on_timeout)
    tx = getattr(jaxsync, f"{ns.strategy}_mean")(
        axis_name="d", comm=comm, timeout=ns.timeout, staging=ns.staging, **action
    )

    def f(r):
        t = {"w": jnp.full((5,), r[0])}
        return tx.update(t, tx.init(t))[0]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))
    x = jnp.arange(d, dtype=jnp.float32) + d * rank  # replica r holds r
    outs = []
    for step in range(ns.steps):
        if rank == 1 and step == ns.stall_step:
            # Die only once rank 0 has started this step (its marker is there):
            # the fault follows rank 0's progress, not the clock (a death before
            # it got there ended the job with no marker to measure from).
            marker = os.path.join(ns.out, f"rank0.step{step}")
            deadline = time.monotonic() + 120
            while ns.how == "die" and not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
            if ns.how == "stop":  # an unreachable peer: alive, but silent for good
                os.kill(os.getpid(), signal.SIGSTOP)
            elif ns.how == "die":  # killed: no MPI_Finalize
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(ns.sleep)
        with open(os.path.join(ns.out, f"rank{rank}.step{step}"), "w") as fh:
            fh.write(str(time.time()))
        outs.append(to_numpy(jax.block_until_ready(g(x))["w"]))
    res.add("outs", outs)
    from jaxsync._comm._topology import Comms

    res.add("reports", [r for w in Comms.of(comm)._watchdogs.values() for r in w.reports])
    res.write()


if __name__ == "__main__":
    main()
