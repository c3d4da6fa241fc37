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


@pytest.fixture(scope="module", params=[1, 2], ids=["devices1", "devices2"])
def control_run(request):
    return run_mpi("worker_control_order.py", n=2, devices=request.param, timeout=240).check()


@pytest.mark.parametrize("mode", MODES)
def test_a_sync_inside_control_flow_is_in_the_step_chain(control_run, mode):
    meta = control_run.results[0]["meta"]
    size, devices = meta["size"], meta["devices"]
    n = size * devices
    layout = control_run.results[0]["layout"]
    for rank in range(size):
        res = control_run.results[rank]
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
