"""What the host tier changes: 16-bit sums rounded once per host, then once more.

Run on 2 hosts x 2 processes, one device each, ``comm_dtype=bfloat16`` and
``reduce="sum"``: rank ``r`` holds ``VALUES[r]`` in every element. Without the
tier (``naive``, or any strategy on one host) the four values are summed in
float32 and rounded once: ``bf16(256 + 1 + 1 + 1) = bf16(259) = 260`` (a tie, to
even). With it, each host's sum is rounded before it crosses, then the hosts'
sum: ``bf16(bf16(256 + 1) + bf16(1 + 1)) = bf16(256 + 2) = 258``.
"""

from _worker import Results, init

VALUES = (256.0, 1.0, 1.0, 1.0)


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    tree = {"x": jnp.full((8,), VALUES[rank], jnp.float32)}
    for strategy in ("naive", "flat", "hierarchical", "two_dimensional"):
        fac = getattr(jaxsync, f"{strategy}_mean")
        tx = fac(axis_name=None, comm=comm, reduce="sum", comm_dtype=jnp.bfloat16)
        out = jax.jit(lambda t, tx=tx: tx.update(t, tx.init(t))[0])(tree)
        res.add(strategy, float(jax.block_until_ready(out)["x"][0]))
    res.write()


if __name__ == "__main__":
    main()
