"""``python -m jaxsync selftest`` with one wrong case on one rank.

Rank 1 (only) replaces ``jaxsync.sign_mean`` by a transform whose leaf ``c`` is
off by one, as a broken sync on one process would be; every rank then runs
selftest's ``main`` and records its exit status (``rc``): the case must fail
on every rank, with rank 1's detail.
"""

from _worker import Results, init


def main():
    ns, _, MPI = init()
    import numpy as np
    import optax

    import jaxsync
    from jaxsync._cli import _selftest

    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 1:
        real = jaxsync.sign_mean

        def wrong(*args, **kwargs):
            tx = real(*args, **kwargs)

            def update(updates, state, params=None):
                out, state = tx.update(updates, state, params)
                return {**out, "c": out["c"] + np.float32(1.0)}, state

            return optax.GradientTransformation(tx.init, update)

        jaxsync.sign_mean = wrong
    rc = _selftest.main(["--mbytes", "0.01", "--iters", "1"])
    res = Results(ns.out, rank)
    res.add("rc", rc)
    res.write()


if __name__ == "__main__":
    main()
