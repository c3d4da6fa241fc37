"""Row-sparse sync across processes (tests/mpi/test_sparse_mpi.py).

Modes:
  exact   N local devices: shard_map (every strategy; coalesce, densify, dense
          mode, reduce sum, staging host), vmap and pmap. Records each result's
          dense form and raw rows.
  one     one device: plain jit (axis_name=None) and a size-1 shard_map axis.
  agree   rank 1 has a different k, then a different num_rows: the same error on
          every rank; then a matching sync still works.
"""

from _worker import local_mesh, start


def main():
    ns, jax, comm, rank, size, L, res = start([(("--mode",), dict(default="exact"))])
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    from sparse_data import V, rows

    import jaxsync
    from jaxsync.sparse._rows import RowSparse

    res.add("replicas", size * L)
    mesh = local_mesh("local")

    def tree_of(gs, k=3, num_rows=V):
        idx, vals = zip(*(rows(g, k=k) for g in gs))
        idx16, vals16 = zip(*(rows(g, jnp.bfloat16, k=k) for g in gs))
        return {
            "emb": RowSparse.tree_unflatten(
                num_rows, (jnp.asarray(np.stack(idx)), jnp.asarray(np.stack(vals)))
            ),
            "emb16": RowSparse.tree_unflatten(
                num_rows, (jnp.asarray(np.stack(idx16)), jnp.asarray(np.stack(vals16)))
            ),
            "w": jnp.asarray(np.stack([np.full(4, g, np.float32) for g in gs])),
        }

    mine = [rank * L + i for i in range(L)]

    def record(key, out, stacked):
        got = {}
        for name in ("emb", "emb16", "w"):
            leaf = out[name]
            if isinstance(leaf, RowSparse):
                i, v = (leaf.indices[0], leaf.values[0]) if stacked else (leaf.indices, leaf.values)
                one = RowSparse.tree_unflatten(leaf.num_rows, (i, v))
                got[name] = ("sparse", np.asarray(one.todense()), np.asarray(i), np.asarray(v))
            else:
                got[name] = ("dense", np.asarray(leaf[0] if stacked else leaf))
        res.add(key, got)

    def attempt(key, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test
            res.add(key, (type(e).__name__, str(e)))

    def spec_tree(s, num_rows):
        return {
            "emb": RowSparse.tree_unflatten(num_rows, (s, s)),
            "emb16": RowSparse.tree_unflatten(num_rows, (s, s)),
            "w": s,
        }

    def run_shard_map(key, tx, tree):
        num_rows = tree["emb"].num_rows

        def step(t):
            t = jax.tree.map(lambda x: x[0], t)
            return tx.update(t, tx.init(t))[0]

        f = jax.jit(
            jax.shard_map(
                step, mesh=mesh, in_specs=(spec_tree(P("local"), num_rows),), out_specs=P()
            )
        )
        record(key, jax.block_until_ready(f(tree)), stacked=False)

    if ns.mode == "exact":
        facs = dict(
            hierarchical=jaxsync.hierarchical_mean,
            flat=jaxsync.flat_mean,
            naive=jaxsync.naive_mean,
            two_dimensional=jaxsync.two_dimensional_mean,
        )
        tree = tree_of(mine)
        for name, fac in facs.items():
            attempt(
                f"shard_map-{name}",
                lambda name=name, fac=fac: run_shard_map(
                    f"shard_map-{name}", fac(axis_name="local", comm=comm), tree
                ),
            )
        options = {
            "coalesce": dict(sparse=jaxsync.SparseOptions(coalesce=True)),
            "densify": dict(sparse=jaxsync.SparseOptions(densify=True)),
            "emb-dense": dict(sparse=jaxsync.SparseOptions(mode={"emb": "dense"})),
            "sum": dict(reduce="sum"),
            "staging_host": dict(staging="host"),
        }
        for name, kw in options.items():
            attempt(
                f"shard_map-hierarchical-{name}",
                lambda name=name, kw=kw: run_shard_map(
                    f"shard_map-hierarchical-{name}",
                    jaxsync.hierarchical_mean(axis_name="local", comm=comm, **kw),
                    tree,
                ),
            )
        tx = jaxsync.hierarchical_mean(axis_name="local", comm=comm)
        f = jax.jit(jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="local"))
        attempt("vmap", lambda: record("vmap", jax.block_until_ready(f(tree)), True))
        f = jax.pmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="local")
        attempt("pmap", lambda: record("pmap", jax.block_until_ready(f(tree)), True))
    elif ns.mode == "one":
        tree = jax.tree.map(lambda x: x[0], tree_of(mine))
        for name, opts in (
            ("", jaxsync.SparseOptions()),
            ("-coalesce", jaxsync.SparseOptions(coalesce=True)),
        ):
            tx = jaxsync.hierarchical_mean(axis_name=None, comm=comm, sparse=opts)
            f = jax.jit(lambda t, tx=tx: tx.update(t, tx.init(t))[0])
            attempt(
                f"jit{name}",
                lambda name=name, f=f: record(f"jit{name}", jax.block_until_ready(f(tree)), False),
            )
        tx = jaxsync.hierarchical_mean(axis_name="local", comm=comm)
        attempt("shard_map-1", lambda: run_shard_map("shard_map-1", tx, tree_of(mine)))
    elif ns.mode == "agree":
        tx = jaxsync.hierarchical_mean(axis_name="local", comm=comm)
        attempt("k", lambda: run_shard_map("k", tx, tree_of(mine, k=3 if rank == 0 else 4)))
        attempt(
            "num_rows",
            lambda: run_shard_map(
                "num_rows", tx, tree_of(mine, num_rows=V if rank == 0 else V + 1)
            ),
        )
        attempt("after", lambda: run_shard_map("after", tx, tree_of(mine)))
    res.write()


if __name__ == "__main__":
    main()
