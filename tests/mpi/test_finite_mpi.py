"""A NaN that one rank alone sees, across processes (worker_finite.py): every
rank skips together and none waits. optax's own recipes (``apply_if_finite``
around the chain, ``MultiSteps(should_skip_update_fn=optax.skip_not_finite)``)
skip on the NaN's rank only and hang its peer at the next step; the short
timeout makes such a hang a failure. Also: accumulation with one
synchronisation per k micro-steps (``accumulate``) and ZeRO-2's
(``sharded(..., accumulate=k)``), and ``sharded`` forwarding ``value=`` to
``reduce_on_plateau``. Values are small integers and halves: exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi


@pytest.fixture(scope="module")
def finite_run():
    return run_mpi("worker_finite.py", n=2, devices=1, timeout=90).check()


def _mean(t, size=2):
    m = (size - 1) / 2 + t
    return {"b": m, "w": m + np.arange(6.0).reshape(2, 3)}


def _check(run, key, want):
    for rank in range(2):
        got = run.results[rank][key]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            for k in w:
                np.testing.assert_array_equal(g[k], np.asarray(w[k], np.float32), err_msg=key)


def _sgd(steps, skip, momentum=0.0):
    p = {"b": 0.0, "w": np.zeros((2, 3))}
    tr = {"b": 0.0, "w": np.zeros((2, 3))}
    out = []
    for t in range(steps):
        if t not in skip:
            tr = {k: _mean(t)[k] + momentum * tr[k] for k in p}
            p = {k: p[k] - tr[k] for k in p}
        out.append(p)
    return out


def test_apply_if_finite_skips_on_every_rank(finite_run):
    _check(finite_run, "apply", _sgd(3, {1}))


@pytest.mark.parametrize("key", ["apply_sharded", "apply_sharded_count"])
def test_apply_if_finite_around_sharded_skips_on_every_rank(finite_run, key):
    _check(finite_run, key, _sgd(3, {1}, momentum=0.5))


@pytest.mark.parametrize("key", ["multisteps", "sharded_accumulate"])
def test_a_non_finite_micro_step_is_dropped_on_every_rank(finite_run, key):
    # micro-steps 0, (1 dropped), 2 | 3, 4: updates after steps 2 and 4
    m = {t: _mean(t) for t in range(5)}
    first = {k: -(m[0][k] + m[2][k]) / 2 for k in m[0]}
    second = {k: first[k] - (m[3][k] + m[4][k]) / 2 for k in m[0]}
    zero = {"b": 0.0, "w": np.zeros((2, 3))}
    _check(finite_run, key, [zero, zero, first, first, second])


def test_accumulate_syncs_once_per_two_micro_steps(finite_run):
    m = {t: _mean(t) for t in range(4)}
    first = {k: -(m[0][k] + m[1][k]) / 2 for k in m[0]}
    second = {k: first[k] - (m[2][k] + m[3][k]) / 2 for k in m[0]}
    zero = {"b": 0.0, "w": np.zeros((2, 3))}
    _check(finite_run, "accumulate", [zero, first, first, second])


def test_sharded_forwards_value_to_reduce_on_plateau(finite_run):
    # a constant loss (mean 2.5 on every rank): the scale halves at each step after the first
    scales = [1.0, 0.5, 0.25]
    p, out = {"b": 0.0, "w": np.zeros((2, 3))}, []
    for t in range(3):
        p = {k: p[k] - scales[t] * _mean(t)[k] for k in p}
        out.append(p)
    _check(finite_run, "plateau", out)
