"""Row-sparse sync under ``mpirun -n 2`` (worker_sparse.py): exact, bitwise.

Every replica's synced ``RowSparse.todense()`` must equal the float64 mean of all
replicas' scattered gradients (integer values, a power-of-two replica count),
and its raw rows must be the same bytes on both ranks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi
from sparse_data import V, expected

pytestmark = requires_mpi

EXACT = [
    "shard_map-hierarchical",
    "shard_map-flat",
    "shard_map-naive",
    "shard_map-two_dimensional",
    "vmap",
    "pmap",
] + [
    f"shard_map-hierarchical-{o}"
    for o in ("coalesce", "densify", "emb-dense", "sum", "staging_host")
]


@pytest.fixture(scope="module")
def exact_run():
    return run_mpi(
        "worker_sparse.py", n=2, devices=2, args=("--mode", "exact"), timeout=240
    ).check()


@pytest.fixture(scope="module")
def one_run():
    return run_mpi("worker_sparse.py", n=2, devices=1, args=("--mode", "one"), timeout=120).check()


@pytest.fixture(scope="module")
def agree_run():
    return run_mpi(
        "worker_sparse.py", n=2, devices=2, args=("--mode", "agree"), timeout=120
    ).check()


def _check(run, key):
    n = run.results[0]["replicas"]
    for rank in (0, 1):
        got = run.results[rank].get(key, "MISSING")
        if isinstance(got, (str, tuple)):
            pytest.fail(f"rank {rank} case {key}: {got}", pytrace=False)
        reduce = "sum" if key.endswith("-sum") else "mean"
        for name, dt in (("emb", np.float32), ("emb16", jnp.bfloat16)):
            want = expected(n, dt, reduce)
            kind, dense = got[name][0], got[name][1]
            sparse_wanted = not (
                key.endswith("densify") or (key.endswith("emb-dense") and name == "emb")
            )
            assert kind == ("sparse" if sparse_wanted else "dense"), (key, name, kind)
            assert dense.dtype == want.dtype and dense.tobytes() == want.tobytes(), (
                f"{key} {name} rank {rank}:\n{dense[:8]}\n{want[:8]}"
            )
            if kind == "sparse":
                k = got[name][2].shape[0]
                assert k == (min(n * 3, V) if key.endswith("coalesce") else n * 3), k
            # Both ranks hold the same bytes (indices and values too).
            other = run.results[1 - rank][key][name]
            for a, b in zip(got[name][1:], other[1:]):
                assert a.tobytes() == b.tobytes(), f"{key} {name}: ranks differ"
        w = got["w"][1]
        want_w = np.full(4, (n - 1) / 2 if reduce == "mean" else n * (n - 1) / 2, np.float32)
        assert w.tobytes() == want_w.tobytes(), (key, w)


@pytest.mark.parametrize("key", EXACT)
def test_exact_two_processes_two_devices(exact_run, key):
    assert exact_run.results[0]["replicas"] == 4
    _check(exact_run, key)


@pytest.mark.parametrize("key", ["jit", "jit-coalesce", "shard_map-1"])
def test_exact_one_device_per_process(one_run, key):
    assert one_run.results[0]["replicas"] == 2
    _check(one_run, key)


@pytest.mark.parametrize("case", ["k", "num_rows"])
def test_agreement_same_error_on_every_rank(agree_run, case):
    errs = [agree_run.results[r][case] for r in (0, 1)]
    for e in errs:
        assert isinstance(e, tuple), f"no error on a rank: {errs}"
        assert "differs between rank 0 and rank 1" in e[1], e[1]
        assert "row-sparse leaf emb" in e[1], e[1]
    # The same message on both ranks (the ValueError inside JAX's runtime error).
    msg = [e[1][e[1].index("jaxsync: the") :] for e in errs]
    assert msg[0] == msg[1]
    want = "k 3 num_rows" if case == "k" else f"num_rows {V} "
    assert want in msg[0]
    _check(agree_run, "after")


@pytest.fixture(scope="module")
def train_run():
    return run_mpi("worker_sparse_train.py", n=2, devices=1, timeout=240).check()


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_training_parity_sparse_vs_dense(train_run, opt):
    """20 steps of an embedding bag (100k x 32 table): sparse sync matches dense
    sync, and the replicas are bit-identical.

    SGD: rtol 1e-5. Adam divides by the root of the second moment, which turns
    a rounding difference in a nearly cancelled gradient element (the compact
    and the dense backward add an example's contributions in another order)
    into a visible one: there the bound is rtol 1e-5 plus atol 1e-5 (a
    thousandth of the learning rate).
    """
    import jax

    atol = 1e-7 if opt == "sgd" else 1e-5
    for rank in (0, 1):
        sp, de = (train_run.results[rank][f"{k}-{opt}"] for k in ("sparse", "dense"))
        assert sp["update_kind"] == "RowSparse", sp["update_kind"]  # sparse on the wire
        assert de["update_kind"] == "ShapeDtypeStruct", de["update_kind"]
        for a, b in zip(
            jax.tree_util.tree_leaves(sp["params"]), jax.tree_util.tree_leaves(de["params"])
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)
    for key in (f"sparse-{opt}", f"dense-{opt}"):
        assert train_run.results[0][key]["digest"] == train_run.results[1][key]["digest"]
    # Training moved the parameters (the comparison could fail).
    assert train_run.results[0][f"sparse-{opt}"]["moved"] > 1e-3
