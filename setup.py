"""Builds jaxsync's native MPI extension (jaxsync/_comm/_native/_jaxsync_mpi*.so).

The extension is a plain shared library of XLA FFI handlers, compiled by the
MPI compiler wrapper so that it links the same MPI as mpi4py. The wrapper is
taken from ``$JAXSYNC_MPICC``, ``$MPICC``, then ``mpicxx`` / ``mpicc`` on PATH.
Without one, jaxsync is built without the extension and a warning says so
(jaxsync then refuses MPI communication on CPU with an error naming the fix);
with ``JAXSYNC_REQUIRE_NATIVE=1`` the build fails instead.

  MPICC=$(which mpicc) pip install --no-build-isolation -e .
  python setup.py build_ext --inplace
"""

import os
import shlex
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_TRIED = ("$JAXSYNC_MPICC", "$MPICC", "mpicxx on PATH", "mpicc on PATH")


def _mpi_compiler():
    for var in ("JAXSYNC_MPICC", "MPICC"):
        value = os.environ.get(var)
        if value:
            exe = shutil.which(shlex.split(value)[0])
            if exe is None:
                raise SystemExit(f"jaxsync: ${var}={value!r} is not an executable.")
            return value
    for name in ("mpicxx", "mpicc"):
        exe = shutil.which(name)
        if exe:
            return exe
    return None


def _warn(msg):
    bar = "!" * 78
    sys.stderr.write(f"\n{bar}\n{msg}\n{bar}\n\n")


class BuildNative(build_ext):
    """Compile with the MPI wrapper (C++17, -O3) against jax.ffi.include_dir()."""

    def build_extensions(self):
        mpicc = _mpi_compiler()
        required = os.environ.get("JAXSYNC_REQUIRE_NATIVE", "") == "1"
        if mpicc is None:
            tried = f"no MPI compiler wrapper found (tried {', '.join(_TRIED)})"
            fix = (
                "Fix: install MPI (e.g. pip install mpich mpi4py, which provide "
                "mpicc) and rerun with MPICC=$(which mpicc) pip install "
                "--no-build-isolation -e ."
            )
            if required:
                raise SystemExit(
                    f"jaxsync: {tried}, and JAXSYNC_REQUIRE_NATIVE=1 "
                    f"requires the native MPI extension. {fix}"
                )
            _warn(
                f"jaxsync: {tried}; building jaxsync WITHOUT its native MPI "
                f"extension, so MPI communication on CPU will raise an error. {fix}"
            )
            self.extensions = []
            return
        try:
            import jax.ffi
        except ImportError as e:
            msg = (
                "jaxsync: the native extension needs jax at build time (its FFI "
                "headers); install jax first and build with "
                "pip install --no-build-isolation -e ."
            )
            if required:
                raise SystemExit(msg) from e
            _warn(msg)
            self.extensions = []
            return
        # The C wrapper (mpicc) compiles C++ too; link it with the C++ runtime.
        cxx = shlex.split(mpicc)
        for ext in self.extensions:
            ext.include_dirs.append(jax.ffi.include_dir())
            ext.extra_compile_args += ["-std=c++17", "-O3"]
            if os.path.basename(cxx[0]).startswith("mpicc"):
                ext.extra_link_args += ["-lstdc++"]
        names = dict(
            compiler=cxx,
            compiler_so=cxx + ["-fPIC"],
            compiler_cxx=cxx,
            compiler_so_cxx=cxx + ["-fPIC"],
            linker_so=cxx + ["-shared"],
            linker_so_cxx=cxx + ["-shared"],
            linker_exe=cxx,
            linker_exe_cxx=cxx,
        )
        known = getattr(self.compiler, "executables", names)
        self.compiler.set_executables(**{k: v for k, v in names.items() if k in known})
        print(f"jaxsync: building the native MPI extension with {mpicc}")
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "jaxsync._comm._native._jaxsync_mpi",
            sources=[
                f"jaxsync/_comm/_native/{name}.cc"
                for name in (
                    "mpi_ffi",
                    "sums",
                    "low16",
                    "move",
                    "agree",
                    "tier",
                    "tier_pipe",
                    "inflight",
                )
            ],
            depends=["jaxsync/_comm/_native/mpi_ffi.h"],
            language="c++",
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
