"""A NaN that one rank alone sees, and accumulation boundaries (test_finite_mpi.py).

Two processes, one device each, plain ``jit`` (``axis_name=None``). Rank r's
gradient leaf j at step t is ``r + t + j`` (mean ``(P - 1) / 2 + t + j``); at
the steps listed in NAN, the last rank's gradient holds a NaN. Each mode runs a
few steps and records the parameters after each; a rank that skipped alone
would wait in the next step's collective (a hang, caught by the harness's
timeout). ``--unsafe apply|sharded|multisteps`` runs optax's own recipes instead (the old advice:
``optax.apply_if_finite`` around the chain, ``optax.skip_not_finite``): they
hang, which is why the suite does not run them.
"""

from _worker import Results, init, to_numpy

NAN = {1}


def main():
    ns, jax, MPI = init([(("--unsafe",), dict(default=""))])
    import jax.numpy as jnp
    import optax

    import jaxsync

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    res = Results(ns.out, rank)
    res.add("meta", {"size": size})
    params = {"b": jnp.zeros(()), "w": jnp.zeros((2, 3))}

    def grads(t):
        g = {
            "b": jnp.asarray(float(rank + t)),
            "w": rank + t + jnp.arange(6.0).reshape(2, 3),
        }
        if t in NAN and rank == size - 1:
            g["w"] = g["w"].at[1, 2].set(jnp.nan)
        return g

    def run(tx, steps, value=False):
        state = tx.init(params)

        def step(g, s, p):
            if value:  # the same on every replica: the mean of the ranks' losses
                loss = jaxsync.replica_mean(jnp.asarray(rank + 2.0), axis_name=None)
                u, s = tx.update(g, s, p, value=loss)
            else:
                u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(step)
        p, out = params, []
        for t in range(steps):
            p, state = f(grads(t), state, p)
            out.append(to_numpy(p))
        return out

    mean = lambda: jaxsync.flat_mean(axis_name=None)
    with jax.numpy_dtype_promotion("standard"):
        if ns.unsafe == "apply":
            res.add("apply", run(optax.apply_if_finite(optax.chain(mean(), optax.sgd(1.0)), 2), 3))
        elif ns.unsafe == "sharded":
            sh = jaxsync.sharded(optax.sgd(1.0), axis_name=None, check_finite=True)
            res.add("apply_sharded", run(optax.apply_if_finite(sh, 2), 3))
        elif ns.unsafe == "multisteps":
            skip = optax.skip_not_finite
            ms = optax.MultiSteps(
                optax.chain(mean(), optax.sgd(1.0)), 2, should_skip_update_fn=skip
            )
            res.add("multisteps", run(ms, 5))
        else:
            tx = jaxsync.apply_if_finite(optax.chain(mean(), optax.sgd(1.0)), 2, axis_name=None)
            res.add("apply", run(tx, 3))
            sh = jaxsync.sharded(optax.sgd(1.0, momentum=0.5), axis_name=None, check_finite=True)
            res.add("apply_sharded", run(jaxsync.apply_if_finite(sh, 2, axis_name=None), 3))
            sh = jaxsync.sharded(optax.sgd(1.0, momentum=0.5), axis_name=None)
            res.add("apply_sharded_count", run(jaxsync.apply_if_finite(sh, 2, axis_name=None), 3))
            skip = jaxsync.skip_not_finite(axis_name=None)
            ms = optax.MultiSteps(
                optax.chain(mean(), optax.sgd(1.0)), 2, should_skip_update_fn=skip
            )
            res.add("multisteps", run(ms, 5))
            sh = jaxsync.sharded(optax.sgd(1.0), axis_name=None, check_finite=True, accumulate=2)
            res.add("sharded_accumulate", run(jaxsync.apply_if_finite(sh, 2, axis_name=None), 5))
            acc = jaxsync.accumulate(optax.chain(mean(), optax.sgd(1.0)), 2, axis_name=None)
            NAN.clear()
            res.add("accumulate", run(acc, 4))
            plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1)
            sh = jaxsync.sharded(optax.chain(optax.sgd(1.0), plateau), axis_name=None)
            res.add("plateau", run(sh, 3, value=True))
    res.write()


if __name__ == "__main__":
    main()
