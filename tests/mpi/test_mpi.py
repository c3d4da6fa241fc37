"""Multi-process tests: worker scripts under ``mpirun -n 2``.

Each worker records per-rank results in a pickle; the assertions live here.
Launching and hang protection: ``mpi_harness.run_mpi``.
Runs of the same worker are shared by a module-scoped fixture, so the whole
file launches a handful of short MPI jobs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mpi_data
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpi_harness import requires_mpi, run_mpi

import jaxsync

pytestmark = requires_mpi

STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")
FACTORIES = dict(
    naive=jaxsync.naive_mean,
    flat=jaxsync.flat_mean,
    hierarchical=jaxsync.hierarchical_mean,
    two_dimensional=jaxsync.two_dimensional_mean,
)


def ml_dtype(name):
    return jnp.dtype(name)


def assert_bitwise(got, want, what):
    """Same leaves, dtypes, shapes and bytes."""
    assert isinstance(got, dict), f"{what}: {got}"
    assert sorted(got) == sorted(want), f"{what}: leaves {sorted(got)} != {sorted(want)}"
    for name in want:
        g, w = np.asarray(got[name]), np.asarray(want[name])
        assert g.dtype == w.dtype, f"{what} leaf {name}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{what} leaf {name}: shape {g.shape} != {w.shape}"
        if g.tobytes() != w.tobytes():
            bits = f"u{g.itemsize}"
            bad = np.flatnonzero(g.reshape(-1).view(bits) != w.reshape(-1).view(bits))
            pytest.fail(
                f"{what} leaf {name} ({g.dtype}): {bad.size} of {g.size} elements "
                f"differ bitwise; first at flat index {bad[0]}: got "
                f"{g.reshape(-1)[bad[0]]!r}, want {w.reshape(-1)[bad[0]]!r}\n"
                f"got  {g.reshape(-1)[:8]}\nwant {w.reshape(-1)[:8]}",
                pytrace=False,
            )


def stacked_expected(n_replicas, rows, reduce):
    """The closed form, repeated for ``rows`` replicas (a leading axis)."""
    exp = mpi_data.expected(np, ml_dtype, n_replicas, reduce)
    return {k: np.broadcast_to(v, (rows, *v.shape)).copy() for k, v in exp.items()}


def result_of(run, rank, key):
    got = run.results[rank].get(key, "MISSING: the worker did not record this case")
    if isinstance(got, str):
        pytest.fail(f"rank {rank} case {key}:\n{got}", pytrace=False)
    return got


# --------------------------------------------------------------------------
# 1. Exact by construction: 2 processes x 4 devices, N = 8 replicas.

EXACT_DEVICES = 4
EXACT_CASES = (
    [f"shard_map-{s}-{r}" for s in STRATEGIES for r in ("mean", "sum")]
    + [f"shard_map-{s}-mean-staging_host" for s in STRATEGIES]
    + [f"shard_map-{s}-{r}-comm_bf16" for s in STRATEGIES for r in ("mean", "sum")]
    + [f"vmap-{s}-mean" for s in STRATEGIES]
    + [f"pmap-{s}-mean" for s in ("hierarchical", "two_dimensional")]
)
RANDOM_CASES = [f"random-shard_map-{s}-mean" for s in STRATEGIES]


@pytest.fixture(scope="module")
def exact_run():
    return run_mpi("worker_exact.py", n=2, devices=EXACT_DEVICES, timeout=150).check()


def test_exact_worker_ran_every_case(exact_run):
    for rank, res in enumerate(exact_run.results):
        assert res["meta"] == dict(rank=rank, size=2, devices=EXACT_DEVICES)
        recorded = sorted(
            k for k in res if k not in ("meta", "leaves") and not k.startswith("calls:")
        )
        assert recorded == sorted(EXACT_CASES + RANDOM_CASES)


@pytest.mark.parametrize("case", EXACT_CASES)
def test_exact_mpi(exact_run, case):
    reduce = "sum" if "-sum" in case else "mean"
    n = 2 * EXACT_DEVICES
    want = stacked_expected(n, EXACT_DEVICES, reduce)
    for rank in range(2):
        assert_bitwise(result_of(exact_run, rank, case), want, f"rank {rank} {case}")


# The GPU path (mpi4jax's targets, one call per buffer, the leader chosen by
# lax.cond) taken on CPU through mpi4jax's CPU bridge: every device-staged case.
MPI4JAX_CASES = [c for c in EXACT_CASES if "staging_host" not in c]


@pytest.fixture(scope="module")
def exact_mpi4jax_run():
    env = {"JAXSYNC_TESTING_MPI4JAX": "1"}
    return run_mpi("worker_exact.py", n=2, devices=EXACT_DEVICES, timeout=150, env=env).check()


@pytest.mark.parametrize("case", MPI4JAX_CASES)
def test_exact_mpi4jax_path(exact_mpi4jax_run, case):
    reduce = "sum" if "-sum" in case else "mean"
    want = stacked_expected(2 * EXACT_DEVICES, EXACT_DEVICES, reduce)
    for rank in range(2):
        assert_bitwise(result_of(exact_mpi4jax_run, rank, case), want, f"rank {rank} {case}")
        calls = exact_mpi4jax_run.results[rank].get(f"calls:{case}")
        if calls is not None and case.startswith("shard_map"):
            targets = {t for t, _ in calls}
            assert "mpi_allreduce_ffi" in targets or "mpi_alltoall_ffi" in targets, targets
            assert not any(t.startswith("jaxsync_") for t in targets), targets


TIER_TARGETS = {"jaxsync_reduce", "jaxsync_bcast", "jaxsync_reduce_scatter", "jaxsync_tier"}
"""The host tier's native targets (processes of one host; see _mpi_backend._host_tier):
its three calls, or its one pipelined call above one chunk."""


@pytest.mark.parametrize("devices", [1, 2])
def test_the_host_tier_costs_nothing_on_one_host(devices, monkeypatch):
    """One host, the tier asked for: every strategy lowers to the very step it
    lowers to with the tier forced off (today's code path), and no tier target
    is called."""
    monkeypatch.setenv("JAXSYNC_HOST_TIER", "1")
    run = run_mpi("worker_tier_lowering.py", n=2, devices=devices, timeout=150).check()
    for rank, res in enumerate(run.results):
        assert res["topology"]["hosts"] == 1, res["topology"]
        keys = [k[: -len(":same")] for k in res if k.endswith(":same")]
        assert len(keys) == 8, keys
        for key in keys:
            assert res[f"{key}:same"], f"rank {rank} {key}: the lowered step changed"
            calls = res[f"{key}:calls"]
            assert not TIER_TARGETS & set(calls), f"rank {rank} {key}: {calls}"
            assert calls[:2] == ["jaxsync_agree", "jaxsync_allreduce"], calls


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_transport_options_change_the_wire(exact_run, strategy):
    """staging / comm_dtype really change what crosses processes (lowered custom calls)."""
    # Leave out the agreement check (one native call, or one host callback, per step).
    calls = {
        v: [
            (t, ty)
            for t, ty in exact_run.results[0][f"calls:shard_map-{strategy}-mean{v}"]
            if not (t == "xla_ffi_python_cpu_callback" and ty == "") and t != "jaxsync_agree"
        ]
        for v in ("", "-staging_host", "-comm_bf16")
    }
    device, host, bf16 = calls[""], calls["-staging_host"], calls["-comm_bf16"]
    # jaxsync's own FFI targets on CPU: one allreduce for the f32 buffers
    assert device and all(t.startswith("jaxsync_") for t, _ in device), device
    f32 = [t for t, ty in device if "f32>" in ty]
    if strategy == "naive":  # one call per leaf, by design
        assert set(f32) == {"jaxsync_allreduce"} and len(f32) == 3, device
    else:  # every f32 buffer of the sync in one call
        assert f32 == ["jaxsync_allreduce"], device
    assert host and all("callback" in t for t, _ in host), host
    # bfloat16 on the wire: the native allreduce takes the 16-bit buffers as they
    # are (it sums them in float32 itself); no float32 buffer crosses.
    assert bf16 and all(
        t == "jaxsync_allreduce" and "xbf16>" in ty and "f32>" not in ty for t, ty in bf16
    ), bf16


def _mesh_2x4():
    devs = jax.devices()
    assert len(devs) >= 8, "tests/conftest.py sets 8 CPU devices"
    return Mesh(np.array(devs[:8]).reshape(2, 4), ("host", "local"))


def _mesh_sync(tx, tree):
    """Run ``tx`` on a (host=2, local=4) mesh: replica r is row r of each leaf."""

    def body(t):
        t = jax.tree_util.tree_map(lambda x: x[0], t)
        out = tx.update(t, tx.init(t))[0]
        return jax.tree_util.tree_map(lambda x: x[None], out)

    spec = P(("host", "local"))
    f = jax.jit(jax.shard_map(body, mesh=_mesh_2x4(), in_specs=spec, out_specs=spec))
    return jax.tree_util.tree_map(np.asarray, jax.block_until_ready(f(tree)))


@pytest.mark.parametrize(
    "options",
    [dict(reduce="mean"), dict(reduce="sum"), dict(comm_dtype=jnp.bfloat16)],
    ids=["mean", "sum", "comm_bf16"],
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exact_mesh_backend(strategy, options):
    """The same closed form with the inter-process stage on a mesh axis, one process."""
    tx = FACTORIES[strategy](axis_name="local", comm=jaxsync.AxisComm("host"), **options)
    tree = mpi_data.make_tree(jnp, np, first_replica=0, count=8)
    got = _mesh_sync(tx, tree)
    assert_bitwise(
        got, stacked_expected(8, 8, options.get("reduce", "mean")), f"mesh {strategy} {options}"
    )


# --------------------------------------------------------------------------
# 5. Mesh backend (one process) and MPI backend give bitwise identical results.


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mesh_and_mpi_backends_agree_bitwise(exact_run, strategy):
    n = 2 * EXACT_DEVICES
    data = mpi_data.random_tree(np, n)
    tx = FACTORIES[strategy](axis_name="local", comm=jaxsync.AxisComm("host"))
    mesh_out = _mesh_sync(tx, {k: jnp.asarray(v) for k, v in data.items()})
    key = f"random-shard_map-{strategy}-mean"
    mpi_out = {
        name: np.concatenate([result_of(exact_run, r, key)[name] for r in range(2)])
        for name in data
    }
    # Sanity: the result is the mean, and every replica holds the same value.
    for name, x in data.items():
        np.testing.assert_allclose(
            mpi_out[name],
            np.broadcast_to(x.astype(np.float64).mean(0), x.shape),
            rtol=1e-5,
            atol=1e-6,
        )
        assert (mpi_out[name] == mpi_out[name][:1]).all(), name
    assert_bitwise(mpi_out, mesh_out, f"MPI vs mesh backend, {strategy}")


# --------------------------------------------------------------------------
# 2. One device per process, axis_name=None, plain jit: N = 2 replicas.


@pytest.fixture(scope="module")
def one_device_run():
    return run_mpi("worker_one_device.py", n=2, devices=1, timeout=90).check()


@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_device_per_process_exact(one_device_run, strategy, reduce):
    want = mpi_data.expected(np, ml_dtype, 2, reduce)
    for rank in range(2):
        assert one_device_run.results[rank]["devices"] == 1
        assert_bitwise(
            result_of(one_device_run, rank, f"{strategy}-{reduce}"),
            want,
            f"rank {rank} {strategy}-{reduce}",
        )


# --------------------------------------------------------------------------
# 3. Training parity: 2 processes x 2 devices vs one process on the whole batch.

TRAIN_STEPS = 25
# Observed: max |difference| ~1.2e-7 on parameters of size ~1 (f32 summation
# order differs); the bound leaves ~100x headroom and is far below the distance
# the parameters travel (> 2e-2 for every leaf).
TRAIN_ATOL = 1e-5
TRAIN_RTOL = 1e-5


@pytest.fixture(scope="module")
def train_run():
    return run_mpi(
        "worker_train.py", n=2, devices=2, timeout=120, args=("--steps", TRAIN_STEPS)
    ).check()


TRAIN_RUNS = ["hierarchical", "two_dimensional", "flat", "hierarchical-sgd"]


@pytest.mark.parametrize("strategy", TRAIN_RUNS)
def test_training_matches_single_process(train_run, strategy):
    """Adam (as asked) hides a wrong gradient scale; the SGD run does not."""
    ref = train_run.results[0]["reference-sgd" if "sgd" in strategy else "reference"]
    assert ref["losses"][-1] < 0.75 * ref["losses"][0], "the reference did not train"
    for rank in range(2):
        got = result_of(train_run, rank, strategy)["params"]
        for name, want in ref["params"].items():
            moved = np.abs(want - ref["initial"][name]).max()
            assert moved > 100 * TRAIN_ATOL, f"leaf {name} barely moved ({moved})"
            assert got[name].shape == (2, *want.shape)
            for replica in range(2):
                np.testing.assert_allclose(
                    got[name][replica],
                    want,
                    rtol=TRAIN_RTOL,
                    atol=TRAIN_ATOL,
                    err_msg=f"{strategy}: rank {rank} replica {replica} leaf {name} "
                    f"after {TRAIN_STEPS} steps vs single-process training",
                )


@pytest.mark.parametrize("strategy", TRAIN_RUNS)
def test_training_replicas_bit_identical(train_run, strategy):
    recs = [result_of(train_run, rank, strategy) for rank in range(2)]
    # Digests gathered with mpi4py inside the job: every rank saw the same list.
    for rank, rec in enumerate(recs):
        assert rec["digests"] == [r["digest"] for r in recs], f"rank {rank}"
    assert recs[0]["digest"] == recs[1]["digest"], "parameters differ across processes"
    # And bitwise, every local replica of every process.
    for name in recs[0]["params"]:
        copies = [rec["params"][name][i] for rec in recs for i in range(2)]
        for i, c in enumerate(copies[1:], 1):
            assert c.tobytes() == copies[0].tobytes(), f"leaf {name}: replica {i} != 0"


# --------------------------------------------------------------------------
# 4. Many buckets in one step, several steps: no deadlock, exact, one trace.


@pytest.fixture(scope="module")
def buckets_run():
    return run_mpi("worker_buckets.py", n=2, devices=2, timeout=240).check()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_many_buckets_exact_no_recompile(buckets_run, strategy):
    import worker_buckets

    n, d, steps = 4, 2, worker_buckets.STEPS
    for rank in range(2):
        res = buckets_run.results[rank]
        assert res["buckets"] >= 30, f"only {res['buckets']} buckets: not a many-bucket test"
        rec = result_of(buckets_run, rank, strategy)
        assert rec["traces"] == 1, f"step traced {rec['traces']} times in {steps} steps"
        assert rec["cache_size"] == 1, f"{rec['cache_size']} compiled versions"
        want = {
            name: np.full((d, *shape), steps * ((n - 1) / 2 + k), np.float32).astype(dtype)
            for k, (name, shape, dtype) in enumerate(res["specs"])
        }
        assert_bitwise(rec["state"], want, f"rank {rank} {strategy}")


# --------------------------------------------------------------------------
# 6. broadcast_params(root=1): every process ends with rank 1's values.


@pytest.fixture(scope="module")
def broadcast_run():
    return run_mpi("worker_broadcast.py", n=2, devices=2, timeout=90).check()


def test_broadcast_params_root_values(broadcast_run):
    import worker_broadcast

    # Rank 1's tree, built here on this process's devices only for its values.
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    from jax.sharding import NamedSharding

    root_tree = worker_broadcast.build(jnp, np, 1, NamedSharding(mesh, P("d")))
    for rank in range(2):
        res = broadcast_run.results[rank]
        assert res["input_unchanged"], f"rank {rank}: the input tree was modified"
        out = res["out"]
        assert sorted(out) == sorted(root_tree)
        for name, leaf in root_tree.items():
            rec = out[name]
            want = np.asarray(leaf)
            what = f"rank {rank} leaf {name}"
            assert rec["type"] == rec["type_before"], f"{what}: {rec['type']}"
            assert rec["dtype"] == str(want.dtype), f"{what}: dtype {rec['dtype']}"
            assert rec["shape"] == want.shape, what
            assert rec["value"].dtype == want.dtype, what
            assert rec["value"].tobytes() == want.tobytes(), (
                f"{what}: {rec['value']} != root's {want}"
            )
            if "shards" in rec:
                assert rec["same_sharding"], f"{what}: sharding changed"
                for dev, index, data in rec["shards"]:
                    sl = tuple(slice(a, b) for a, b in index)
                    assert data.tobytes() == want[sl].tobytes(), f"{what} on {dev}"
    sharded = broadcast_run.results[0]["out"]["sharded"]["shards"]
    assert len(sharded) == 2 and sharded[0][1] != sharded[1][1], "not a sharded array"
    assert len(broadcast_run.results[0]["out"]["replicated"]["shards"]) == 2


def test_broadcast_params_non_array_leaves(broadcast_run):
    """An equinox-like tree (a function, Python scalars, a string): under mpirun -n 2
    the root's scalars (types kept) and the static leaves as they are, as in one
    process; today's failure was a TypeError naming no leaf (issue 32)."""
    import worker_broadcast

    root = worker_broadcast.mixed(jnp, np, 1)
    for rank in range(2):
        got = result_of(broadcast_run, rank, "mixed")
        assert got.pop("act_is_relu") is True, f"rank {rank}: act is not jax.nn.relu"
        for k, (kind, value) in got.items():
            want = root[k]
            assert kind == type(want).__name__, (rank, k, kind)
            assert np.asarray(value).tobytes() == np.asarray(want).tobytes(), (rank, k, value)
        assert sorted(got) == sorted(k for k in root if k != "act")
    one = jaxsync.broadcast_params(worker_broadcast.mixed(jnp, np, 1), comm=None)
    assert one["act"] is jax.nn.relu and one["p"] == 1.5 and type(one["n"]) is int


def test_broadcast_params_refuses_the_same_leaf_on_every_rank(broadcast_run):
    import worker_broadcast

    with pytest.raises(TypeError) as one:
        jaxsync.broadcast_params(worker_broadcast.refused(jnp), comm=None)
    for rank in range(2):
        msg = broadcast_run.results[rank]["refused"]
        assert msg == str(one.value), f"rank {rank}: {msg}"
    assert "['spec']" in msg and "eqx.filter(model, eqx.is_array)" in msg


def test_overlap_warns_only_without_an_inter_process_stage(broadcast_run):
    for rank in range(2):
        assert broadcast_run.results[rank]["warnings_world"] == [], rank
        (msg,) = broadcast_run.results[rank]["warnings_self"]
        assert "no inter-process stage (the communicator holds one process)" in msg
        assert "overlap=True" in msg and "double_buffering=True" in msg


# --------------------------------------------------------------------------
# 7. Agreement: mismatched trees give the same ValueError on every rank.


@pytest.fixture(scope="module")
def agree_run():
    return run_mpi("worker_agree.py", n=2, devices=2, timeout=90, args=("--watchdog", 80)).check()


def in_step_error(kind, msg):
    """The agreement raises inside the compiled step (at its first run): JAX
    reports the ValueError as a JaxRuntimeError holding it. Returns the
    ValueError's (kind, message); other errors unchanged."""
    # On CPU the check is jaxsync's native call (its error status), elsewhere a
    # host callback (a ValueError): JAX reports either as a JaxRuntimeError.
    for marker in ("ValueError: jaxsync:", "FAILED_PRECONDITION: jaxsync:"):
        if kind == "JaxRuntimeError" and marker in msg:
            return "ValueError", msg[msg.index(marker) + len(marker) - len("jaxsync:") :].strip()
    return kind, msg


def _same_error_everywhere(run, key):
    errs = [in_step_error(*run.results[rank][key]) for rank in range(2)]
    for rank, (kind, msg) in enumerate(errs):
        assert kind == "ValueError", f"rank {rank} {key}: {kind}: {msg}"
    assert errs[0] == errs[1], f"{key}: ranks raised different errors:\n{errs}"
    msg = errs[0][1]
    assert "rank 0" in msg and "rank 1" in msg, msg
    return msg


@pytest.mark.parametrize("api", ["sync", "broadcast"])
@pytest.mark.parametrize("case", ["structure", "shape", "dtype"])
def test_agreement_same_error_on_every_rank(agree_run, api, case):
    msg = _same_error_everywhere(agree_run, f"{api}-{case}")
    if case == "shape":
        assert "['w']" in msg and "(2, 3)" in msg and "(3, 2)" in msg, msg
    if case == "dtype":
        assert "['w']" in msg and "float32" in msg and "bfloat16" in msg, msg


@pytest.mark.parametrize("api", ["sync", "broadcast"])
def test_agreement_structure_names_leaf_path(agree_run, api):
    msg = _same_error_everywhere(agree_run, f"{api}-structure")
    assert "['layer'][2]" in msg, msg


def test_agreement_options_differ(agree_run):
    msg = _same_error_everywhere(agree_run, "sync-options")
    assert "mean" in msg and "sum" in msg, msg


def test_agreement_processes_still_in_step(agree_run):
    for rank in range(2):
        kind, out = agree_run.results[rank]["after-errors"]
        assert kind == "OK", out
        assert_bitwise(out, {"w": np.full((2, 3), 0.5, np.float32)}, f"rank {rank}")


def test_agreement_checked_after_an_earlier_agreed_tree(tmp_path):
    run = run_mpi(
        "worker_agree.py", n=2, devices=2, timeout=60, out=tmp_path, args=("--mode", "cached")
    )
    assert not run.timed_out and run.returncode != 124, "hang (watchdog fired):\n" + run.describe()
    run.check()
    for rank in range(2):
        assert run.results[rank]["first"][0] == "OK", run.results[rank]["first"]
    msg = _same_error_everywhere(run, "second")
    assert "['w']" in msg and "(3,)" in msg and "(4,)" in msg, msg


# --------------------------------------------------------------------------
# 8. Process death and clean exit.

DEATH_BOUND_S = 60


@pytest.mark.parametrize("mode", ["die_before_sync", "die_after_compile"])
def test_process_death_ends_the_job(tmp_path, mode):
    run = run_mpi(
        "worker_death.py",
        n=2,
        devices=2,
        timeout=DEATH_BOUND_S + 30,
        out=tmp_path,
        args=("--mode", mode),
    )
    # How far each rank got (rank0.calling, rank1.exiting, ...), for a failure.
    marks = sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".pkl")
    assert not run.timed_out, f"the job hung after rank 1 died ({marks}):\n" + run.describe()
    assert run.elapsed < DEATH_BOUND_S, f"{marks}\n" + run.describe()
    assert run.returncode != 0, run.describe()
    assert (tmp_path / "rank0.calling").exists(), (
        "rank 0 never reached the sync:\n" + run.describe()
    )
    assert not (tmp_path / "rank0.returned").exists(), (
        "rank 0's sync returned without rank 1:\n" + run.describe()
    )


def test_exit_right_after_jitted_syncs_is_clean(tmp_path):
    run = run_mpi(
        "worker_death.py",
        n=2,
        devices=2,
        timeout=DEATH_BOUND_S,
        out=tmp_path,
        args=("--mode", "exit_after_async"),
    )
    assert not run.timed_out, "deadlock at exit:\n" + run.describe()
    assert run.returncode == 0, run.describe()
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.dispatched").exists(), run.describe()
    assert "Traceback" not in run.output, run.describe()


# --------------------------------------------------------------------------
# Processes with different local device counts (2 and 4): 6 replicas.


@pytest.fixture(scope="module")
def uneven_run():
    return run_mpi(
        "worker_uneven.py", n=2, devices="2,4", timeout=90, args=("--watchdog", 80)
    ).check()


def _check_uneven(run, strategy):
    """Either the right mean (2.5) on every replica or the same ValueError everywhere."""
    outs = [run.results[rank][strategy] for rank in range(2)]
    assert [run.results[r]["devices"] for r in range(2)] == [2, 4]
    if all(kind == "OK" for kind, _ in outs):
        for rank, (_, w) in enumerate(outs):
            np.testing.assert_array_equal(
                w,
                np.full_like(w, 2.5),
                err_msg=f"{strategy}: rank {rank} (replicas 6 = 2 + 4, mean 2.5)",
            )
    else:
        outs = [in_step_error(*o) for o in outs]
        assert outs[0] == outs[1] and outs[0][0] == "ValueError", outs


def test_uneven_device_counts_two_dimensional(uneven_run):
    _check_uneven(uneven_run, "two_dimensional")


@pytest.mark.parametrize("strategy", ["naive", "flat", "hierarchical"])
def test_uneven_device_counts(uneven_run, strategy):
    _check_uneven(uneven_run, strategy)


# --------------------------------------------------------------------------
# Rows 10 and 12 (tests/_common.py): straggler under the watchdog; several syncs in one step.


@pytest.fixture(scope="module")
def watchdog_run():
    return run_mpi("worker_watchdog.py", n=2, devices=2, timeout=120).check()


def test_watchdog_names_the_straggler_and_the_result_stays_right(watchdog_run):
    # replicas r = 0..3 hold r: the mean is 1.5 at every step, straggler or not
    for rank in range(2):
        for strategy in ("hierarchical", "two_dimensional"):
            for out in watchdog_run.results[rank][f"straggler-{strategy}"]:
                np.testing.assert_array_equal(out, np.full(5, 1.5, np.float32))
    reports = watchdog_run.results[0]["watchdog-reports"]
    assert len(reports) >= 2, reports  # one per strategy's delayed step
    assert all("ranks not arrived: 1" in r for r in reports), reports
    assert "jaxsync watchdog: rank 0 has waited" in watchdog_run.output
    assert watchdog_run.results[1]["watchdog-reports"] == []  # rank 1 never waited


def test_two_syncs_with_many_buckets_in_one_step(watchdog_run):
    for rank in range(2):
        a, b = watchdog_run.results[rank]["two-syncs"]
        for k in range(30):
            np.testing.assert_array_equal(a[f"a{k}"], np.full(20, 1.5 + k, np.float32))
            np.testing.assert_array_equal(
                b[f"b{k}"].astype(np.float32), np.full(7, 1.5 - k, np.float32)
            )
        assert watchdog_run.results[rank]["two-syncs-traces"] == 1


@pytest.fixture(scope="module")
def host_order_run():
    return run_mpi("worker_host_order.py", n=2, devices=1, timeout=120).check()


@pytest.mark.parametrize("strategy", ["naive", "flat", "hierarchical"])
def test_host_staging_keeps_callback_order(host_order_run, strategy):
    for rank in range(2):
        assert host_order_run.results[rank][strategy] == 0, (
            f"rank {rank}: leaves matched with the wrong leaves of the other rank"
        )


# --------------------------------------------------------------------------
# Issue 10: tracing on one rank, comm="auto", custom nodes, NaN / float16,
# watchdog rounds, exits with host staging (worker_harden.py).


def _harden(tmp_path, mode, timeout=90, devices=2):
    return run_mpi(
        "worker_harden.py",
        n=2,
        devices=devices,
        timeout=timeout,
        out=tmp_path,
        args=("--mode", mode),
    )


def test_tracing_alone_on_rank0_never_blocks_and_auto_is_mpi(tmp_path):
    """rank 0 alone: eval_shape, lower, make_jaxpr; then both train (comm='auto')."""
    run = _harden(tmp_path, "trace_alone")
    assert not run.timed_out and run.returncode != 124, (
        "hang: tracing on rank 0 alone blocked\n" + run.describe()
    )
    run.check()
    for rank in range(2):
        assert run.results[rank]["backend"].startswith("MPIBackend(size=2"), run.results[rank][
            "backend"
        ]
        for out in run.results[rank]["train"]:  # replicas 0..3 hold 0..3
            np.testing.assert_array_equal(out, np.full(5, 1.5, np.float32))
    assert run.results[0]["alone"] == ("(5,)", True, True)


def test_agreement_ignores_custom_node_aux_data(tmp_path):
    run = _harden(tmp_path, "custom_node").check()
    reprs = run.results[0]["aux-reprs"]
    assert "0x" in reprs[0] and reprs[0] != reprs[1], reprs  # the case is exercised
    for rank in range(2):
        kind, out = run.results[rank]["sync"]
        assert kind == "OK", out
        np.testing.assert_array_equal(out, np.full(3, 1.5, np.float32))
        kind, out = run.results[rank]["broadcast"]
        assert kind == "OK", out
        np.testing.assert_array_equal(out, np.full(3, 1.0, np.float32))


def test_nan_and_float16_predivide_across_processes(tmp_path):
    run = _harden(tmp_path, "nan_f16").check()
    for rank in range(2):
        w, v, finite = run.results[rank]["nan"]
        assert np.isnan(w).all(), w  # one NaN replica poisons the mean
        np.testing.assert_array_equal(v, np.full(3, 1.5, np.float32))
        assert finite is False, f"rank {rank}: all_finite should be False"
        for staging in ("device", "host"):
            # 4 replicas x 40000 overflows float16 (max 65504) unless predivided
            h = run.results[rank][f"f16-{staging}"]
            assert h.dtype == np.float16
            np.testing.assert_array_equal(h, np.full(6, 40000.0, np.float16))


def test_watchdog_many_short_syncs_then_clean_exit(tmp_path):
    run = _harden(tmp_path, "watchdog_loop", timeout=150)
    assert not run.timed_out and run.returncode == 0, run.describe()
    run.check()
    assert "Traceback" not in run.output, run.describe()
    for rank in range(2):
        rounds = run.results[rank]["rounds"]
        assert len(rounds) == 20
        for out, freed, made, all_null in rounds:
            np.testing.assert_array_equal(out, np.full(7, 1.5, np.float32))
            # world, control, agreement, 2 per-device, 1 watchdog: all freed
            assert freed == 1 and made == 6 and all_null, (freed, made, all_null)


def test_exit_right_after_host_staged_syncs_is_clean(tmp_path):
    run = _harden(tmp_path, "host_exit", timeout=60)
    assert not run.timed_out, "deadlock at exit:\n" + run.describe()
    assert run.returncode == 0, run.describe()
    run.check()
    assert "Traceback" not in run.output, run.describe()


def test_host_staging_requires_thread_multiple(tmp_path):
    run = _harden(tmp_path, "thread_level", timeout=60).check()
    for rank in range(2):
        kind, msg = run.results[rank]["host"]
        assert kind == "RuntimeError" and "MPI_THREAD_MULTIPLE" in msg, (kind, msg)


# Ordering: one token chain through every inter-process call of a step, across
# synchronisations (mixed bf16/f32 trees, many buckets, several syncs, many steps).


def _order_expected(n, steps, leaves_a, leaves_b, rows):
    """Per step (A, B, C) closed forms for ``n`` replicas, ``rows`` leading rows."""

    def dt(k):
        return np.float32 if k % 2 == 0 else jnp.bfloat16

    def full(shape, v, dtype):
        return np.full((rows, *shape) if rows else shape, v, np.float32).astype(dtype)

    out = []
    for s in range(steps):
        a = {f"a{k:02d}": full((5 + k,), (n - 1) / 2 + k + s, dt(k)) for k in range(leaves_a)}
        b = {
            f"b{k:02d}": full((3, 2 + k), (n - 1) / 2 + 2 * k + s, dt(k + 1))
            for k in range(leaves_b)
        }
        out.append((a, b, a))
    return out


@pytest.fixture(scope="module", params=[(2, 2), (3, 1)], ids=["n2-devices2", "n3-devices1"])
def order_run(request):
    n, devices = request.param
    return run_mpi("worker_order.py", n=n, devices=devices, timeout=240).check()


@pytest.mark.parametrize("mode", ["jit", "vmap", "shard_map", "shard_map-host"])
def test_syncs_in_one_step_stay_ordered(order_run, mode):
    meta = order_run.results[0]["meta"]
    size, devices = meta["size"], meta["devices"]
    if mode == "jit" and devices != 1:
        pytest.skip("axis_name=None needs one device per process")
    layout = order_run.results[0]["layout"]
    want = _order_expected(
        size * devices,
        layout["steps"],
        layout["leaves_a"],
        layout["leaves_b"],
        rows=0 if mode == "jit" else devices,
    )
    if mode != "shard_map-host":
        # Structure: one token for the step, every call takes the previous call's.
        calls, tokens = order_run.results[0]["chain:" + mode]
        assert tokens == 1 and len(calls) >= 6, (tokens, calls)
        for (prev, _, _), (_, target, tok) in zip(calls, calls[1:]):
            assert tok == f"{prev}#0", f"{target} takes {tok}, not {prev}#0: {calls}"
    for rank in range(size):
        got = result_of(order_run, rank, mode)
        assert len(got) == layout["steps"]
        for s, (g, w) in enumerate(zip(got, want)):
            for part, name in zip(range(3), "ABC"):
                assert_bitwise(g[part], w[part], f"rank {rank} {mode} step {s} sync {name}")


# --------------------------------------------------------------------------
# jaxsync's native MPI targets: every dtype, several syncs in one step, one and
# several local devices; the compiled step around the MPI call.

NATIVE_STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


@pytest.fixture(
    scope="module",
    params=[(2, 1), (2, 2), (3, 1)],
    ids=["procs2-devices1", "procs2-devices2", "procs3-devices1"],
)
def native_run(request):
    procs, devices = request.param
    return run_mpi("worker_native.py", n=procs, devices=devices, timeout=180).check()


def _native_expected(run, rows):
    import worker_native

    meta = run.results[0]["meta"]
    n = meta["size"] * meta["devices"]
    return {
        name: np.full((rows, *shape), (n - 1) / 2 + k, np.float32).astype(jnp.dtype(dt))
        if dt != "float64"
        else np.full((rows, *shape), (n - 1) / 2 + k, np.float64)
        for k, (name, dt, shape) in enumerate(worker_native.LEAVES)
    }


def test_native_library_loaded(native_run):
    for rank in range(2):
        st = native_run.results[rank]["status"]
        assert st["loaded"] and st["error"] is None, st
        assert st["built_against"] and st["mpi_library"], st


@pytest.mark.parametrize("mode", ["shard_map", "vmap"])
def test_native_every_dtype_several_syncs_exact(native_run, mode):
    d = native_run.results[0]["meta"]["devices"]
    want = _native_expected(native_run, d)
    for rank in range(2):
        got = result_of(native_run, rank, mode)
        for i, step in enumerate(got if mode == "shard_map" else [got]):
            for s in NATIVE_STRATEGIES:
                assert_bitwise(step[s], want, f"rank {rank} {mode} call {i} {s}")


def test_native_allreduce_sums_several_dtypes_in_one_call(native_run):
    size = native_run.results[0]["meta"]["size"]
    ranks = range(size)
    for rank in ranks:
        a, b, c = result_of(native_run, rank, "direct")
        # sums of rank + 1, rank + 0.5 and rank + 2 over the ranks
        np.testing.assert_array_equal(a, np.full(4, sum(r + 1.0 for r in ranks), np.float32))
        assert b.dtype == np.float64
        np.testing.assert_array_equal(b, np.full(3, sum(r + 0.5 for r in ranks)))
        np.testing.assert_array_equal(c, np.full(5, sum(r + 2 for r in ranks), np.int32))


def test_native_rejects_complex_sum_naming_the_dtype(native_run):
    msg = native_run.results[0]["bad-dtype"]
    assert "does not support dtype complex64" in msg, msg


def test_native_16_bit_sum_is_float32_fold_rounded_once(native_run):
    """bfloat16/float16 buffers (past the target's chunk size, odd sizes, tiny
    values) summed by the native allreduce: bit for bit the float32 left fold in
    rank order rounded once, on every rank."""
    for rank in range(2):
        res = native_run.results[rank]["direct16"]
        assert not isinstance(res, str), res
        assert len(res["got"]) == len(res["want"]) == 77
        for i, (g, w) in enumerate(zip(res["got"], res["want"])):
            assert g.dtype == w.dtype, (i, g.dtype, w.dtype)
            assert_bitwise({"buffer": g}, {"buffer": w}, f"rank {rank} buffer {i} ({w.size})")


def test_native_compiled_step_has_no_copy_or_cond(native_run):
    """One in-place MPI call for all buffers (16-bit ones too), no cond; a
    size-1 local axis costs nothing (no all-reduce, no copy in the step)."""
    d = native_run.results[0]["meta"]["devices"]
    hlo = native_run.results[0]["hlo"]
    assert hlo["calls"] == 1 and hlo["aliasing"], hlo["text"]
    assert hlo["conditional"] == 0, hlo["text"]
    assert hlo["effects"] == [], hlo["effects"]  # jit keeps its fast dispatch path
    if d == 1:
        assert hlo["all_reduce"] == 0 and hlo["copy"] == 0, hlo["text"]
    want = _native_expected(native_run, d)
    for rank in range(2):
        got = result_of(native_run, rank, "hlo-run")
        assert_bitwise(got, {k: v for k, v in want.items() if k in got}, f"rank {rank}")


def test_native_flat_one_device_packs_in_the_target(native_run):
    """flat with one device per process: the leaves go to the one native call
    as they are (the target packs them): no concatenate and no copy in XLA."""
    d = native_run.results[0]["meta"]["devices"]
    hlo = native_run.results[0]["hlo-flat"]
    assert hlo["calls"] == 1, hlo["text"]
    if d == 1:
        assert hlo["concatenate"] == 0 and hlo["copy"] == 0, hlo["text"]
    else:  # several devices: flat packs in XLA before the intra-process sum
        assert hlo["concatenate"] >= 1, hlo["text"]
