"""jaxsync.timeline under mpirun: a hierarchical_mean step and an overlapped one
(sums on the communication lane), three steps each, marked with ``tl.step()``.
Records each step's lowered text with the timeline on and off (it must not
change), the means (exact: replica r holds r + k), and the trace file's path."""

from _worker import Results, init, to_numpy


def main():
    ns, jax, MPI = init([(("--dir",), dict(required=True))])
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    D = jax.local_device_count()
    res = Results(ns.out, rank)
    res.add("meta", dict(rank=rank, size=comm.Get_size(), devices=D))
    mesh = Mesh(np.array(jax.devices()), ("d",))
    txs = {
        "hierarchical": jaxsync.hierarchical_mean(axis_name="d", comm=comm),
        "overlap": jaxsync.flat_mean(
            axis_name="d", comm=comm, overlap=True, overlap_bucket_bytes=4096
        ),
    }
    grads = lambda r: {f"g{k}": jnp.full((1000 + 100 * k,), 1.0) * (r + k) for k in range(4)}

    def make(tx):
        def body(r):
            g = grads(r[0])
            return jax.tree_util.tree_map(lambda x: x[None], tx.update(g, tx.init(g))[0])

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    r = jnp.arange(D, dtype=jnp.float32) + D * rank
    steps = {name: make(tx) for name, tx in txs.items()}
    res.add("lowered_off", {n: f.lower(r).as_text() for n, f in steps.items()})
    outs = {}
    with jaxsync.timeline(ns.dir) as tl:
        res.add("lowered_on", {n: f.lower(r).as_text() for n, f in steps.items()})
        for name, f in steps.items():
            outs[name] = []
            for i in range(3):
                with tl.step(f"{name} {i}"):
                    outs[name].append(to_numpy(jax.block_until_ready(f(r))))
    res.add("outs", outs)
    res.add("path", str(tl.path))
    res.write()


if __name__ == "__main__":
    main()
