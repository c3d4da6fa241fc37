"""overlap="auto" (the default) under mpirun: off within one host, on across hosts,
for ``hierarchical_mean`` and for ``auto_mean`` (whose default was ``False``).

One host (mpirun on this machine): the default's lowered step is the text that
``overlap=False`` lowers to (no asynchronous call). Two hosts faked
(``_host_tier.decide`` reporting 2 hosts for a fresh duplicate of the world, so
its ``Comms`` counts them, as the emulated cluster's namespaces would): the
default lowers to ``overlap=True``'s step (asynchronous sums per bucket), and its
result has the blocking sync's bits.
"""

import re

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np

    import jaxsync
    from jaxsync._comm import _host_tier
    from jaxsync._comm._topology import Comms

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    res = Results(ns.out, rank)
    # 8 MB and a small leaf: more than one 4 MiB bucket
    tree = {"w": jnp.arange(2_000_000.0) * (rank + 1) / 3, "b": jnp.ones((7,)) * rank}

    def make(comm, factory=jaxsync.hierarchical_mean, **kw):
        tx = factory(None, comm, **kw)
        fn = jax.jit(lambda t: tx.update(t, tx.init(t))[0])
        # every traced synchronisation is a new agreement instance: not compared
        text = re.sub(r"agree_instance = -?\d+", "agree_instance = N", fn.lower(tree).as_text())
        return text, fn

    def record(name, comm, factory=jaxsync.hierarchical_mean):
        default, run_default = make(comm, factory)
        off, run_off = make(comm, factory, overlap=False)
        on, _ = make(comm, factory, overlap=True)
        res.add(f"{name}:hosts", Comms.of(comm).hosts)  # what the factory reads
        res.add(f"{name}:same_as_off", default == off)
        res.add(f"{name}:same_as_on", default == on)
        res.add(f"{name}:calls", sorted(set(re.findall(r"custom_call @(jaxsync_\w+)", default))))
        a, b = run_default(tree), run_off(tree)
        same = all(
            np.asarray(x).tobytes() == np.asarray(y).tobytes()
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
        )
        res.add(f"{name}:bits_as_blocking", same)

    record("one", world.Dup())
    record("auto_mean:one", world.Dup(), jaxsync.auto_mean)
    real = _host_tier.decide

    def two_hosts(control, r):
        tier, base, _ = real(control, r)
        return tier, base, 2

    _host_tier.decide = two_hosts
    try:
        record("two", world.Dup())
        record("auto_mean:two", world.Dup(), jaxsync.auto_mean)
    finally:
        _host_tier.decide = real
    res.write()


if __name__ == "__main__":
    main()
