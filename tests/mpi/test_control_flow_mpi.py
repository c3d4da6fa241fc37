"""A synchronisation inside ``lax.cond``, ``lax.scan`` or ``lax.while_loop``
(``optax.MultiSteps``' update runs inside ``lax.cond``) is ordered with those
around it in one token chain, also when the ranks' programs differ
(``worker_control_order.py``; before the chain was threaded through control
flow this hung)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi

MODES = ["multisteps", "cond", "scan", "while"]


# The GPU path (mpi4jax's targets) taken on CPU through mpi4jax's CPU bridge: its
# chain crosses control flow by data (``_ordering.chain_after``); before, the
# ranks issued their calls in different orders (MPI: "Message truncated").
PATHS = {"native": None, "mpi4jax": {"JAXSYNC_TESTING_MPI4JAX": "1"}}


@pytest.fixture(
    scope="module",
    params=[(1, "native"), (2, "native"), (1, "mpi4jax"), (2, "mpi4jax")],
    ids=lambda p: f"devices{p[0]}-{p[1]}",
)
def control_run(request):
    devices, path = request.param
    run = run_mpi("worker_control_order.py", n=2, devices=devices, timeout=240, env=PATHS[path])
    run.path = path
    return run.check()


@pytest.mark.parametrize("mode", MODES)
def test_a_sync_inside_control_flow_is_in_the_step_chain(control_run, mode):
    meta = control_run.results[0]["meta"]
    size, devices = meta["size"], meta["devices"]
    n = size * devices
    layout = control_run.results[0]["layout"]
    for rank in range(size):
        res = control_run.results[rank]
        want = {"native": ["jaxsync_native"], "mpi4jax": ["jaxsync_mpi"]}[control_run.path]
        assert res["calls:" + mode] == want, res["calls:" + mode]
        # One chain: every synchronising operation depends on the one before it.
        assert res["chain:" + mode] == [], res["chain:" + mode]
        got = res[mode]
        assert not isinstance(got, str), got
        assert len(got) == layout["steps"]
        for s, (out, first, metric) in enumerate(got):
            shape = (devices,) if devices > 1 else ()
            np.testing.assert_array_equal(first, np.full(shape, (n - 1) / 2 + s + 1, np.float32))
            np.testing.assert_array_equal(metric, np.full(shape, (n - 1) / 2 + s, np.float32))
            for k in range(layout["leaves"]):
                want = np.full(shape + (5 + k,), (n - 1) / 2 + k + s, np.float32)
                np.testing.assert_array_equal(out[f"g{k}"], want)
