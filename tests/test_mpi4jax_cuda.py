"""The GPU path's lowering runs mpi4jax's CUDA set-up (issue 46, item 18).

mpi4jax's CUDA bridge starts handing MPI device pointers; its own lowering first
runs ``setup_cuda_mpi``, which turns on staging through host memory unless
``MPI4JAX_USE_CUDA_MPI=1``. jaxsync binds mpi4jax's CUDA targets with its own
primitive, so its lowering must run that set-up too. On this CPU-only machine
the step is lowered for CUDA (``jax.export``, no GPU needed) with a stand-in for
the CUDA bridge, whose ``set_copy_to_host`` records what it was told.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("mpi4jax")


@pytest.fixture
def bridge(monkeypatch):
    """A stand-in CUDA bridge; mpi4jax's set-up state reset (it runs once)."""
    from mpi4jax._src import decorators, xla_bridge

    told: list[bool] = []
    fake = types.SimpleNamespace(set_copy_to_host=told.append, set_logging=lambda on: None)
    monkeypatch.setattr(xla_bridge, "HAS_CUDA_EXT", True)
    monkeypatch.setattr(xla_bridge, "mpi_xla_bridge_cuda", fake, raising=False)
    monkeypatch.setattr(decorators, "_cuda_mpi_setup_done", False)
    return told


def _lower_for_cuda(kind="allreduce"):
    from jaxsync._comm import _mpi4jax_prim
    from jaxsync._comm._mpi_load import _load

    comm = _load().COMM_WORLD

    def f(x):
        y, _ = _mpi4jax_prim.call(kind, x, jax.lax.create_token(), comm)
        return y

    ok = [jax.export.DisabledSafetyCheck.custom_call(f"mpi_{kind}_ffi")]
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=ok)
    return exp(jnp.ones(4)).mlir_module()


@pytest.mark.parametrize("env, staged", [("0", True), ("1", False)])
def test_the_cuda_lowering_runs_mpi4jax_setup(monkeypatch, bridge, env, staged):
    monkeypatch.setenv("MPI4JAX_USE_CUDA_MPI", env)
    text = _lower_for_cuda()
    assert "mpi_allreduce_ffi" in text  # mpi4jax's CUDA target, bound by jaxsync
    assert bridge == [staged]  # host staging unless MPI4JAX_USE_CUDA_MPI=1
    _lower_for_cuda("bcast")
    assert bridge == [staged]  # once per process, as mpi4jax does


def test_unset_it_stages_through_host_and_says_so(monkeypatch, bridge):
    monkeypatch.delenv("MPI4JAX_USE_CUDA_MPI", raising=False)
    with pytest.warns(UserWarning, match="MPI4JAX_USE_CUDA_MPI=1"):
        _lower_for_cuda()
    assert bridge == [True]
