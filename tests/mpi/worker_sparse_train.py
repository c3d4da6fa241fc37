"""Training parity: an embedding-bag classifier, sparse sync vs dense sync.

A 100,000 x 32 table, 4 ids per example, 32 examples per process and step, a
linear head; 20 steps data-parallel with one device per process. Each rank
records the parameters after training with

  sparse-sgd    row_sparse_grad -> hierarchical_mean (RowSparse gathered)
                -> sparse_sgd -> apply_sparse_updates
  sparse-adam   row_sparse_grad -> hierarchical_mean -> densify -> adam
  dense-sgd     jax.grad -> hierarchical_mean -> sgd (the dense table reduced)
  dense-adam    jax.grad -> hierarchical_mean -> adam

and a digest of its parameter bytes (replicas must be bit-identical).
"""

import hashlib

from _worker import Results, init

V, DIM, C, B, IDS, STEPS = 100_000, 32, 4, 32, 4, 20


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxsync

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    res = Results(ns.out, rank)
    rng = np.random.default_rng(0)  # same on every rank: the initial parameters
    params0 = {
        "emb": jnp.asarray(rng.normal(size=(V, DIM)) * 0.1, jnp.float32),
        "head": {
            "w": jnp.asarray(rng.normal(size=(DIM, C)) * 0.1, jnp.float32),
            "b": jnp.zeros(C, jnp.float32),
        },
    }
    # Generated data: each process its own examples; the label is a function of
    # the ids (so the model can learn it). Ids repeat within and across ranks.
    data = np.random.default_rng(100 + rank)
    batches = []
    for _ in range(STEPS):
        ids = data.integers(0, 2000, size=(B, IDS)).astype(np.int32) * 50
        batches.append({"ids": jnp.asarray(ids), "y": jnp.asarray((ids[:, 0] // 50) % C)})

    def loss_fn(p, b):
        h = p["emb"][b["ids"]].mean(axis=1)
        logits = h @ p["head"]["w"] + p["head"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def train(sparse, opt):
        if sparse:
            tail = (
                jaxsync.sparse_sgd(0.5)
                if opt == "sgd"
                else optax.chain(jaxsync.densify(), optax.adam(1e-2))
            )
        else:
            tail = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2)
        sync = jaxsync.hierarchical_mean(axis_name=None, comm=comm)
        tx = optax.chain(sync, tail)

        def grads(p, b):
            if sparse:
                return jaxsync.row_sparse_grad(loss_fn, p, b, tables={"emb": "ids"})
            return jax.grad(loss_fn)(p, b)

        @jax.jit
        def step(p, s, b):
            u, s = tx.update(grads(p, b), s, p)
            p = jaxsync.apply_sparse_updates(p, u) if sparse else optax.apply_updates(p, u)
            return p, s

        p, s = params0, tx.init(params0)
        for b in batches:
            p, s = step(p, s, b)
            jax.block_until_ready(p)
        # What the sync hands on for the table (a trace-time fact).
        synced = jax.eval_shape(
            lambda p, b: sync.update(grads(p, b), sync.init(p))[0], p, batches[0]
        )
        return p, type(synced["emb"]).__name__

    for opt in ("sgd", "adam"):
        for sparse in (True, False):
            key = f"{'sparse' if sparse else 'dense'}-{opt}"
            p, kind = train(sparse, opt)
            leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(p)]
            digest = hashlib.sha256(b"".join(x.tobytes() for x in leaves)).hexdigest()
            res.add(
                key,
                {
                    "params": jax.tree_util.tree_map(np.asarray, p),
                    "digest": digest,
                    "update_kind": kind,
                    "moved": float(np.abs(leaves[0] - np.asarray(params0["emb"])).max()),
                },
            )
    res.add("size", size)
    res.write()


if __name__ == "__main__":
    main()
