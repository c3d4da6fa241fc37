"""A process that exits with overlapped MPI calls still in flight.

It dispatches several overlapped (and double-buffered) steps of a model whose
gradients take a while to sum, never blocks on them, records that it got this
far and returns: the interpreter must wait for the calls (jaxsync's exit hook)
before MPI is finalised, and the job must exit 0 with no error.
"""

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import optax

    import jaxsync

    comm = MPI.COMM_WORLD
    res = Results(ns.out, comm.Get_rank())
    params = [jnp.ones((512, 512)) * (i + 1) for i in range(6)]
    x = jnp.ones((64, 512))

    def loss(p, x):
        h = x
        for w in p:
            h = jnp.tanh(h @ w)
        return jnp.sum(h)

    for kw in (dict(overlap=True, overlap_bucket_bytes=2**18), dict(double_buffering=True)):
        tx = optax.chain(jaxsync.hierarchical_mean(None, comm, **kw), optax.sgd(1e-3))

        @jax.jit
        def step(p, s, x, tx=tx):
            u, s = tx.update(jax.grad(loss)(p, x), s, p)
            return optax.apply_updates(p, u), s

        p, s = params, tx.init(params)
        for _ in range(4):
            p, s = step(p, s, x)  # never blocked on
    res.add("dispatched", True)
    res.write()


if __name__ == "__main__":
    main()
