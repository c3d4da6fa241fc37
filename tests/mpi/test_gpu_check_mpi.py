"""scripts/gpu_check.py, the GPU check's Python part, dry-run on CPU under
``mpirun -n 2`` through mpi4jax's CPU bridge (``JAXSYNC_TESTING_MPI4JAX=1``, the
path a GPU takes): every check passes and the table names each one, so the
script is known to work before a GPU machine is lent to run it."""

import sys

from mpi_harness import MPIRUN, ROOT, _env, requires_mpi, run_command

pytestmark = requires_mpi


def test_gpu_check_passes_on_the_mpi4jax_path(tmp_path):
    out = tmp_path / "gpu_check.md"
    cmd = [str(MPIRUN), "-n", "2", sys.executable, str(ROOT / "scripts" / "gpu_check.py")]
    cmd += ["--out", str(out), "--mib", "1", "--iters", "2"]
    env = {**_env(), "JAXSYNC_TESTING_MPI4JAX": "1", "JAX_PLATFORMS": "cpu"}
    code, output, timed_out = run_command(cmd, timeout=300, env=env)
    assert not timed_out and code == 0, output[-4000:]
    table = out.read_text()
    assert "14/14 checks passed" in output, output[-4000:]
    for name in (
        "the step calls mpi4jax",
        "two_dimensional_mean {'overlap': True}",
        "double_buffering=True",
        "Quantized(bits=8)",
        "sharded",
        "broadcast_params",
        "local_sgd",
        "mpi4jax allreduce (bare)",
    ):
        assert name in table, (name, table)
    assert "FAIL" not in table, table
