"""The test tree of the exact cases, shared by the workers and the pytest side.

Leaf ``k`` of replica ``r`` is filled with ``r + k``. Shapes include a scalar,
sizes that do not divide the device count (padding in two_dimensional) and
three float dtypes in one tree (one buffer per dtype).
"""

# (name, shape, dtype): names sort in leaf order, so leaf k is the k-th name.
LEAVES = (
    ("k0", (3,), "float32"),
    ("k1", (2, 5), "bfloat16"),
    ("k2", (), "float16"),
    ("k3", (7,), "float32"),
    ("k4", (4, 2), "float16"),
    ("k5", (5,), "bfloat16"),
    ("k6", (1,), "float32"),
)


def make_tree(jnp, np, first_replica, count):
    """Leaves of shape ``(count, *shape)``: row ``i`` is replica ``first_replica + i``."""
    tree = {}
    for k, (name, shape, dtype) in enumerate(LEAVES):
        rows = [np.full(shape, first_replica + i + k, np.float32) for i in range(count)]
        tree[name] = jnp.asarray(np.stack(rows)).astype(jnp.dtype(dtype))
    return tree


def expected(np, ml_dtype, n, reduce):
    """Closed form per leaf name for ``n`` replicas."""
    out = {}
    for k, (name, shape, dtype) in enumerate(LEAVES):
        v = (n - 1) / 2 + k if reduce == "mean" else n * (n - 1) / 2 + n * k
        out[name] = np.full(shape, v, np.float32).astype(ml_dtype(dtype))
    return out


# Random f32 leaves for the mesh-vs-MPI comparison (row 14 of the table in tests/_common.py).
RANDOM_LEAVES = (("a", (33,)), ("b", (4, 5)), ("c", ()), ("d", (130,)))


def random_tree(np, n, seed=0):
    """Global numpy leaves of shape ``(n, *shape)``: row ``r`` is replica ``r``."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal((n, *shape)).astype(np.float32) for name, shape in RANDOM_LEAVES
    }
