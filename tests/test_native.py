"""The native MPI library's loader: a clear error when it is not built."""

import pytest

import jaxsync
from jaxsync._comm import _mpi_backend, _mpi_load


@pytest.fixture
def missing_library(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "_jaxsync_mpi.so"
    monkeypatch.setenv(_mpi_load.NATIVE_ENV, str(missing))
    _mpi_load._native.cache_clear()
    yield missing
    _mpi_load._native.cache_clear()


def test_missing_native_library_names_file_and_fix(missing_library):
    with pytest.raises(_mpi_load.NativeUnavailableError) as e:
        _mpi_load.require_native()
    msg = str(e.value)
    assert str(missing_library) in msg
    assert "bash scripts/setup.sh" in msg and "pip install --no-build-isolation -e ." in msg


def test_missing_native_library_fails_at_transform_construction(missing_library):
    # The error comes before any communicator is used (no MPI needed here).
    with pytest.raises(_mpi_load.NativeUnavailableError, match="not built"):
        _mpi_backend.MPIBackend(comm=object())


def test_native_status_reports_missing_library(missing_library):
    st = _mpi_load.native_status()
    assert st["path"] == str(missing_library)
    assert st["built"] is False and st["loaded"] is False
    assert "setup.sh" in st["error"]


def test_native_error_is_an_import_error_subclass():
    assert issubclass(_mpi_load.NativeUnavailableError, jaxsync._comm._mpi_load.MPIUnavailableError)
    assert issubclass(_mpi_load.NativeUnavailableError, ImportError)
