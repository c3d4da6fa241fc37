"""Issue 10, single process: launcher checks, argument checks, broadcast, scaling.

The multi-process halves are in tests/mpi/test_mpi.py (worker_harden.py).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import MESH1, MESH2, FakeComm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._comm import _mpi_backend, _topology
from jaxsync._core import _config, _sync
from jaxsync._core._plan import make_plan, structure_text
from jaxsync._core._reduce16 import UNROLL, rows_sum_f32

# --------------------------------------------------------------------------
# Item 2: a launched job must not silently train alone.


def _fake_mpi(monkeypatch, size):
    world = types.SimpleNamespace(Get_size=lambda: size)
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = world
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", pkg)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return world


def _clear_launcher(monkeypatch):
    for k in _topology._MPI_ENV + _topology._LAUNCHER_SIZE_ENV:
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("var", ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_auto_raises_when_launcher_has_more_processes_than_mpi(monkeypatch, var):
    _clear_launcher(monkeypatch)
    monkeypatch.setenv(var, "4")
    _fake_mpi(monkeypatch, 1)  # PMI not wired: MPI sees one process
    with pytest.raises(_topology.LaunchError, match=f"{var}=4.*comm=None"):
        jaxsync.hierarchical_mean(axis_name="i")
    with pytest.raises(_topology.LaunchError):
        jaxsync.broadcast_params({"w": jnp.ones(2)})


def test_auto_raises_when_launched_but_mpi4py_missing(monkeypatch):
    _clear_launcher(monkeypatch)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(_topology.LaunchError, match="mpi4py cannot be imported"):
        _topology.default_comm()


def test_auto_raises_under_srun_without_mpi_wiring(monkeypatch):
    """srun -n 2 --mpi=none (or MpiDefault=none): no PMI variable, so MPI would see
    one process on each task and every task train alone (found under tests/slurm)."""
    _clear_launcher(monkeypatch)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    with pytest.raises(_topology.LaunchError, match=r"SLURM_STEP_NUM_TASKS=2.*--mpi=pmi2"):
        _topology.default_comm()
    with pytest.raises(_topology.LaunchError, match="srun"):
        jaxsync.hierarchical_mean(axis_name="i")
    assert jaxsync.hierarchical_mean(axis_name="i", comm=None)  # on purpose: fine
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # srun -n 1
    assert _topology._srun_tasks_without_mpi() == 0
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("PMI_RANK", "0")  # --mpi=pmi2 wires it
    assert _topology._srun_tasks_without_mpi() == 0
    monkeypatch.delenv("PMI_RANK")
    from jax._src import distributed

    monkeypatch.setattr(distributed.global_state, "client", object())  # jax.distributed
    assert _topology._srun_tasks_without_mpi() == 0


def test_auto_single_process_launch_is_fine(monkeypatch):
    _clear_launcher(monkeypatch)
    monkeypatch.setenv("PMI_SIZE", "1")  # mpirun -n 1
    _fake_mpi(monkeypatch, 1)
    assert _topology.default_comm() is None
    monkeypatch.setenv("PMI_SIZE", "2")
    world = _fake_mpi(monkeypatch, 2)
    assert _topology.default_comm() is world
    # An explicit comm=None is always accepted, launcher or not.
    _fake_mpi(monkeypatch, 1)
    jaxsync.hierarchical_mean(axis_name="i", comm=None)


# --------------------------------------------------------------------------
# Item 9: argument checks.


def test_invalid_comm_does_not_import_mpi():
    code = (
        "import sys, jaxsync\n"
        "try:\n    jaxsync.flat_mean(axis_name='i', comm=42)\n"
        "except TypeError as e:\n    assert 'comm' in str(e), e\n"
        "else:\n    raise SystemExit('no TypeError')\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'mpi4py.MPI was imported'\n"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in _topology._MPI_ENV + _topology._LAUNCHER_SIZE_ENV
    }
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_single_node_rejects_a_comm():
    with pytest.raises(ValueError, match="single_node.*ignores comm"):
        jaxsync.sync_gradients(
            {"w": jnp.ones(2)}, axis_name="i", strategy="single_node", comm=jaxsync.AxisComm("host")
        )


def test_sync_gradients_returns_the_finite_flag():
    g = {"w": jnp.arange(8.0)}
    plain = jax.vmap(lambda t: jaxsync.sync_gradients(t, axis_name="i", comm=None), axis_name="i")(
        g
    )
    assert isinstance(plain, dict)  # default unchanged
    g = {"w": jnp.arange(8.0).at[3].set(jnp.nan)}
    out, ok = jax.vmap(
        lambda t: jaxsync.sync_gradients(t, axis_name="i", comm=None, check_finite=True),
        axis_name="i",
    )(g)
    assert ok.shape == (8,) and not bool(ok.any())
    assert np.isnan(np.asarray(out["w"])).all()


def _fake_mpi_backend():
    be = object.__new__(_mpi_backend.MPIBackend)
    be.comm, be.staging, be.timeout = None, "device", None
    return be


@pytest.mark.parametrize("axis_name", [None, "local"])
def test_unsynced_device_axis_raises_with_the_fix(axis_name):
    cfg = _config.make_config("t", "hierarchical", axis_name, None)
    cfg = dataclasses.replace(cfg, backend=_fake_mpi_backend())
    mesh, spec = (MESH1, P("i")) if axis_name is None else (MESH2, P(("host", "local")))

    def body(x):
        return _sync.sync({"w": x}, cfg)[0]["w"]

    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    with pytest.raises(ValueError, match="every device would run MPI") as info:
        jax.eval_shape(f, jnp.ones(8))
    assert "axis_name=" in str(info.value)
    # vmap axes are fine (one message, every replica a row): no error at trace time
    ok = _config.make_config("t", "hierarchical", None, None)
    assert ok.backend.name == "none"


# --------------------------------------------------------------------------
# Item 4: the agreed text has no auxiliary data.


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Static:
    fn: object


def test_structure_text_ignores_aux_data():
    a = {"s": _Static(lambda: 1), "w": [jnp.ones(2)]}
    b = {"s": _Static(lambda: 2), "w": [jnp.ones(2)]}
    ta, tb = (jax.tree_util.tree_structure(t) for t in (a, b))
    assert str(ta) != str(tb)  # addresses in the aux data
    assert structure_text(ta) == structure_text(tb)
    assert make_plan(a).describe() == make_plan(b).describe()
    c = {"s": _Static(None), "w": (jnp.ones(2),)}  # list -> tuple: a real difference
    assert structure_text(jax.tree_util.tree_structure(c)) != structure_text(ta)


def test_options_text_includes_staging_and_check_finite():
    d = _config.make_config("t", "flat", "i", None, check_finite=True).describe()
    assert "check_finite True" in d and "staging" in d


# --------------------------------------------------------------------------
# Item 5: broadcast keeps shardings.


def test_broadcast_axis_comm_keeps_sharding():
    sh = NamedSharding(MESH1, P("i"))
    rep = NamedSharding(MESH1, P())
    tree = {
        "w": jax.device_put(jnp.arange(8.0), sh),
        "r": jax.device_put(jnp.ones((2, 3), jnp.bfloat16), rep),
        "n": np.int32(3),
    }
    out = jaxsync.broadcast_params(tree, comm=jaxsync.AxisComm("host"))
    assert out["w"].sharding == sh, out["w"].sharding
    assert out["r"].sharding == rep and out["r"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(8.0))
    assert np.asarray(out["n"]) == 3


# --------------------------------------------------------------------------
# Item 10: graphs and messages that do not grow with the process count.


def _left_fold_f32(rows):
    acc = rows[0].astype(np.float32)
    for r in rows[1:]:
        acc = (acc + r.astype(np.float32)).astype(np.float32)
    return acc


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, UNROLL, UNROLL + 1, 33])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rows_sum_f32_is_the_left_fold_bitwise(k, dtype):
    rng = np.random.default_rng(k)
    rows = rng.standard_normal((k, 257)) * 10.0 ** rng.integers(-3, 3, (k, 1))
    rows = np.asarray(jnp.asarray(rows, dtype))
    got = np.asarray(jax.jit(rows_sum_f32)(jnp.asarray(rows)))
    want = _left_fold_f32(rows.astype(np.float32))
    assert got.dtype == np.float32
    assert got.tobytes() == want.tobytes()


def test_rows_sum_f32_graph_is_constant_in_the_row_count():
    sizes = {
        k: len(jax.make_jaxpr(rows_sum_f32)(jnp.zeros((k, 4), jnp.bfloat16)).eqns)
        for k in (16, 1024)
    }
    assert sizes[1024] == sizes[16] and sizes[1024] < 20, sizes


def test_broadcast_params_sends_digests_not_texts_at_scale(monkeypatch):
    comm = FakeComm(1024)  # every process agrees
    tree = {f"layer{i}": {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)} for i in range(50)}
    try:
        out = jaxsync.broadcast_params(tree, comm=comm)
    finally:
        jaxsync.free_communicators(comm)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert comm.gathered and all(isinstance(g, bytes) and len(g) == 32 for g in comm.gathered), [
        type(g) for g in comm.gathered
    ]


# --------------------------------------------------------------------------
# Item 7: the watchdog stops promptly and ignores late replies.


class _Status:
    def __init__(self):
        self.source = -1

    def Get_source(self):
        return self.source


class _WatchComm:
    """Rank 0 of 2; rank 1 answers only what ``replies`` holds (a list)."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.queries = []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Iprobe(self, source=None, tag=None, status=None):
        from jaxsync._comm._watchdog import _REPLY

        if tag == _REPLY and self.replies:
            status.source = 1
            return True
        return False

    def recv(self, source=None, tag=None):
        return self.replies.pop(0)

    def send(self, obj, dest=None, tag=None):
        self.queries.append(obj)

    def isend(self, obj, dest=None, tag=None):
        self.send(obj, dest, tag)
        return _Sent()


class _Sent:
    def Test(self):
        return True


@pytest.fixture
def fake_mpi_status(monkeypatch):
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.Status, mpi.ANY_SOURCE = _Status, -1
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", pkg)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)


def _stalled(comm, timeout):
    import io

    from jaxsync._comm._watchdog import Watchdog

    wd = Watchdog(comm, timeout, stream=io.StringIO())
    wd.enter(None)  # inside a stage...
    with wd._lock:
        wd.t_enter -= 10 * timeout  # ...for a long time already
    return wd


def test_watchdog_stop_does_not_wait_out_a_report(fake_mpi_status):
    import time

    wd = _stalled(_WatchComm([]), timeout=5.0)  # rank 1 never answers
    deadline = time.monotonic() + 5
    while not wd.comm.queries and time.monotonic() < deadline:
        time.sleep(0.01)  # the report has started: it waits up to 5 s for answers
    assert wd.comm.queries, "no report started"
    t0 = time.monotonic()
    wd.stop()
    took = time.monotonic() - t0
    assert not wd._thread.is_alive(), "stop() returned with the thread still in MPI"
    assert took < 1.0, f"stop() took {took:.1f} s"


def test_watchdog_ignores_replies_of_an_earlier_round(fake_mpi_status):
    import time

    # A reply from an earlier round (rank 1 had entered 0) arrives first; this
    # round's reply says rank 1 has entered 1 stage, like rank 0.
    comm = _WatchComm([(0, 0, 0), (1, 1, 0)])
    wd = _stalled(comm, timeout=0.2)
    deadline = time.monotonic() + 10
    while not wd.reports and time.monotonic() < deadline:
        time.sleep(0.01)
    wd.stop()
    assert wd.reports, "no report"
    assert comm.queries[0] == 1  # the round number travels with the query
    assert "every rank has arrived" in wd.reports[0], wd.reports


def test_mpi_side_effects_are_io_callbacks():
    """Host-staged MPI calls and watchdog hooks are effects JAX keeps, once each."""
    from jaxsync._comm._watchdog import _tie

    ops = _mpi_backend._HostOps(FakeComm(size=2))
    jaxpr = str(jax.make_jaxpr(lambda x: ops.allgather(ops.allreduce([x])[0]))(jnp.ones(3)))
    jaxpr += str(jax.make_jaxpr(lambda x: _tie(lambda h: h, x))(jnp.ones(3)))
    assert "io_callback" in jaxpr and "pure_callback" not in jaxpr, jaxpr


# --------------------------------------------------------------------------
# The MPI suite may be skipped without MPI, but never in CI.


@pytest.mark.parametrize("ci", ["", "true"])
def test_mpi_suite_without_mpirun_fails_in_ci(ci):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CI", "XLA_FLAGS")
        and not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "MV2_"))
    }
    env.update(JAXSYNC_MPIRUN="/nonexistent/mpirun", CI=ci)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:nbmake",
            "-o",
            "addopts=",
            "tests/mpi/test_mpi.py",
            "-k",
            "test_exact_mesh_backend and mean and naive",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=300,
    )
    if ci:
        assert r.returncode != 0 and ("1 failed" in r.stdout or "1 error" in r.stdout), r.stdout[
            -2000:
        ]
        assert "CI is set but the MPI suite cannot run" in r.stdout, r.stdout[-2000:]
    else:
        assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout[-2000:]


class _FakeOps:
    """Inter-process ops of a simulated 1024-process job (shapes only)."""

    wire16 = True

    def __init__(self, size):
        self.size = size

    def allreduce(self, bufs):
        return list(bufs)

    def alltoall(self, x):
        return x

    def allgather(self, x):
        return jnp.broadcast_to(x[None], (self.size, *x.shape))


def _sum_low_eqns(size):
    from jaxsync._core import _strategies

    ops = _FakeOps(size)
    jaxpr = jax.make_jaxpr(lambda x: _strategies._sum_low(ops, x))(
        jnp.zeros(4 * size, jnp.bfloat16)
    )
    return len(jaxpr.eqns)


def test_16bit_sum_graph_does_not_grow_with_the_process_count():
    assert _sum_low_eqns(1024) == _sum_low_eqns(16)
