"""jaxsync.local with slice_anchor=True across processes: 4 processes of one
device, 2 islands of 2 processes (islands = a split of the world), so each
process holds half of the anchor and of the outer state, averages its half with
its peer of the other island and the new anchor is all-gathered in the island.
Records each step's parameters for slice_anchor True and False (and the
anchor's leaf shapes), and streaming's mean in flight (overlap=True, whole
anchor); test_local_mpi.py and, across 2 emulated hosts (``--islands host``: an
island a host), tests/cluster/test_cluster_local.py compare them bitwise. Then
rank 1 alone builds DiLoCo with another ``every``: the error every rank records."""

from _worker import Results, init, to_numpy


def main():
    ns, jax, MPI = init([(("--islands",), dict(default="split"))])
    import jax.numpy as jnp
    import optax

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    if ns.islands == "host":
        isl = jaxsync.islands("host", comm=comm)
    else:
        isl = jaxsync.islands(comm.Split(rank // 2, key=rank), comm=comm)
    res.add("islands", [isl.count, isl.index])
    # dyadic targets: process r pulls toward c_r (5 + 3 elements: padded slices)
    c = {"x": jnp.arange(5.0) * (rank - 1.5), "y": jnp.full((3,), 2.0 * rank - 3.0)}
    for sliced in (False, True, "overlap"):
        for name, make in (
            ("diloco", lambda s: jaxsync.diloco(
                optax.chain(jaxsync.hierarchical_mean(None, isl.comm), optax.sgd(0.5)),
                optax.sgd(0.5, momentum=0.5), every=2, islands=isl, slice_anchor=s is True)),
            ("streaming", lambda s: jaxsync.diloco(
                optax.chain(jaxsync.hierarchical_mean(None, isl.comm), optax.sgd(0.5)),
                optax.sgd(0.5, momentum=0.5), every=4, fragments=2, delay=1, mix=0.5,
                islands=isl, slice_anchor=s is True, overlap=s == "overlap")),
        ):  # fmt: skip
            if sliced == "overlap" and name == "diloco":
                continue
            tx = make(sliced)
            p = {"x": jnp.full((5,), 4.0), "y": jnp.full((3,), -2.0)}
            s = tx.init(p)

            def step(p, s, tx=tx):
                u, s = tx.update(jax.tree.map(lambda a, b: a - b, p, c), s, p)
                return optax.apply_updates(p, u), s

            f, out = jax.jit(step), []
            for _ in range(8):
                p, s = f(p, s)
                out.append(to_numpy(p))
            res.add(f"{name}:{sliced}", out)
            res.add(f"{name}:{sliced}:anchor", {k: list(v.shape) for k, v in s.anchor.items()})
    # Rank 1 alone (island 0's second process) runs another schedule: the same
    # error on every rank at the first step, not ranks 0 and 2 waiting in the
    # inner mean for the peers whose outer communicator found it.
    tx = jaxsync.diloco(
        optax.chain(jaxsync.hierarchical_mean(None, isl.comm), optax.sgd(0.5)),
        every=4 if rank == 1 else 2,
        islands=isl,
    )
    p = {"x": jnp.full((5,), 4.0), "y": jnp.full((3,), -2.0)}
    try:
        u, _ = jax.jit(tx.update)(jax.tree.map(lambda a, b: a - b, p, c), tx.init(p), p)
        jax.block_until_ready(u)
        res.add("disagree", ("OK", ""))
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        res.add("disagree", (type(e).__name__, str(e)))
    res.write()


if __name__ == "__main__":
    main()
