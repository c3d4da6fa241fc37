"""The native target at and past its limits (issue 27), exact by construction.

Modes:
  large        MPI's int count: ``JAXSYNC_TESTING_MAX_COUNT`` (the target's
               private knob) lowers the most elements one MPI call is given to
               1000, so leaves of a few thousand elements cross it (as 2^31
               elements would without the knob). ``hierarchical_mean(reduce=
               "sum")`` of one bfloat16 leaf (the 16-bit path: a float32 add and
               one rounding with 2 processes, the all-to-all with 3) and one
               float32 leaf; the native all-gather and all-to-all called
               directly. Every result is recorded with its reference.
  alltoall     the native all-to-all's shape check: operands whose leading axis
               is not the communicator's size are refused, at trace time
               (``native_call``) and by the target itself (a primitive bound
               with a wrong ``size``); a right one moves its rows exactly.
  concurrent   two synchronised programs on two communicators run at the same
               time, from two threads started in opposite orders on the two
               ranks: the first-run agreements of both must complete.
"""

import os
import threading

from _worker import Results, init, to_numpy

LIMIT = 1000  # elements per MPI call in mode "large"


def main():
    ns, jax, MPI = init([(("--mode",), dict(required=True))])
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    import jaxsync
    from jaxsync._comm import _native_prim

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    res = Results(ns.out, rank)
    handle = jnp.int32(comm.py2f())

    def attempt(key, fn):
        try:
            res.add(key, fn())
        except Exception as e:  # recorded; pytest fails the case with the message
            res.add(key, f"ERROR: {type(e).__name__}: {e}")

    def native(kind, x, size=size):
        _, (y,) = _native_prim.native_call(
            kind, [x], jax.lax.create_token(), handle, jnp.int32(1), size
        )
        return y

    if ns.mode == "large":
        # Read by the target at its first call (none has run yet).
        os.environ["JAXSYNC_TESTING_MAX_COUNT"] = str(LIMIT)

        def bf16_of(r, n):
            g = np.random.default_rng([r, n])
            return (g.standard_normal(n) * 1e3).astype(np.float32).astype(ml_dtypes.bfloat16)

        nb, nf = 40_003, 5_001  # > 64 KiB (summed where it is), and packed
        tx = jaxsync.hierarchical_mean(axis_name=None, comm=comm, reduce="sum")
        tree = {"b": jnp.asarray(bf16_of(rank, nb)), "f": jnp.arange(nf, dtype=jnp.float32) + rank}
        step = jax.jit(lambda t: tx.update(t, tx.init(t))[0])
        acc = bf16_of(0, nb).astype(np.float32)
        for r in range(1, size):
            acc = acc + bf16_of(r, nb).astype(np.float32)  # rank order, rounded once
        want = {
            "b": acc.astype(ml_dtypes.bfloat16),
            "f": np.arange(nf, dtype=np.float32) * size + sum(range(size)),
        }
        attempt("sync", lambda: dict(got=to_numpy(jax.block_until_ready(step(tree))), want=want))

        n = 2_500  # per process: more than LIMIT
        mine = np.arange(n, dtype=np.int32) + 10_000 * rank
        attempt(
            "allgather",
            lambda: dict(
                got=np.asarray(jax.jit(lambda x: native("allgather", x))(mine)),
                want=np.stack([np.arange(n, dtype=np.int32) + 10_000 * r for r in range(size)]),
            ),
        )
        low = bf16_of(rank, n)
        attempt(
            "allgather-bf16",
            lambda: dict(
                got=np.asarray(jax.jit(lambda x: native("allgather", x))(low)),
                want=np.stack([bf16_of(r, n) for r in range(size)]),
            ),
        )

        def rows(src):  # row j goes to rank j
            return np.stack(
                [np.arange(n, dtype=np.int32) + 1_000_000 * src + 10_000 * j for j in range(size)]
            )

        attempt(
            "alltoall",
            lambda: dict(
                got=np.asarray(jax.jit(lambda x: native("alltoall", x))(rows(rank))),
                want=np.stack([rows(src)[rank] for src in range(size)]),
            ),
        )
    elif ns.mode == "alltoall":
        for name, shape in (("one-row", (1, size)), ("rows-of-one", (2 * size, 1))):

            def call(shape=shape):
                x = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
                return np.asarray(jax.jit(lambda x: native("alltoall", x))(x))

            attempt(f"trace-{name}", call)
        # The target's own check: the primitive told a wrong size (1) gets a
        # (1, size) operand, which the trace-time check (size 1) accepts.
        x = np.arange(size, dtype=np.int32).reshape(1, size)
        attempt("target", lambda: np.asarray(jax.jit(lambda x: native("alltoall", x, 1))(x)))
        x = np.arange(3 * size, dtype=np.int32).reshape(size, 3) + 100 * rank
        attempt(
            "right",
            lambda: dict(
                got=np.asarray(jax.jit(lambda x: native("alltoall", x))(x)),
                want=np.stack(
                    [
                        np.arange(3 * rank, 3 * rank + 3, dtype=np.int32) + 100 * s
                        for s in range(size)
                    ]
                ),
            ),
        )
    elif ns.mode == "concurrent":
        # Two user communicators: each its own duplicates (world, agreement).
        comms = [comm, comm.Dup()]
        steps = []
        for c in comms:
            tx = jaxsync.hierarchical_mean(axis_name=None, comm=c, reduce="sum")
            steps.append(jax.jit(lambda t, tx=tx: tx.update(t, tx.init(t))[0]))
        trees = [{"w": jnp.full((3,), float(rank + 10 * k))} for k in range(2)]
        for k in range(2):  # compile both first: the threads then only run them
            steps[k].lower(trees[k]).compile()
        outs = {}

        def run(k):
            outs[k] = np.asarray(jax.block_until_ready(steps[k](trees[k]))["w"])

        # Rank 0 starts program 0 first, rank 1 program 1: each blocks in its
        # first-run agreement until the other rank runs the same program.
        order = (0, 1) if rank == 0 else (1, 0)
        threads = []
        for k in order:
            t = threading.Thread(target=run, args=(k,), daemon=True)
            t.start()
            threads.append(t)
            t.join(timeout=1.0)  # the first is well inside its agreement by now
        for t in threads:
            t.join(timeout=20.0)
        res.add("done", sorted(outs))
        res.add("outs", outs)
        res.add(
            "want",
            {
                k: np.full((3,), float(sum(r + 10 * k for r in range(size))), np.float32)
                for k in (0, 1)
            },
        )
        res.write()
        if any(t.is_alive() for t in threads):
            os._exit(5)  # deadlocked: a thread is stuck in MPI, exit cannot finalize
        return
    res.write()


if __name__ == "__main__":
    main()
