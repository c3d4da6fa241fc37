"""Check a finished set-up; run by scripts/setup.sh from outside the checkout.

Usage: python scripts/verify_install.py CHECKOUT

Every extra must import, pinned versions must match, ``import jaxsync`` must resolve
to CHECKOUT through the install (not the current folder), mpirun must sit next to
the interpreter, and the MPI bridges asked for must be built, and jaxsync's native MPI target must
load. Exits 1 naming each
problem and its fix.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys


def main(checkout: str) -> int:
    problems: list[str] = []
    if pathlib.Path.cwd().resolve() == pathlib.Path(checkout).resolve():
        problems.append("run this from outside the checkout, or it proves nothing")
    mods = {}
    for name in (
        "jax",
        "optax",
        "numpy",
        "mpi4py",
        "mpi4jax",
        "jaxsync",
        "pytest",
        "hypothesis",
        "nbmake",
        "xdist",  # pytest-xdist
        "ipykernel",
        "rich",
        "matplotlib",
        "sklearn",
        "flax",
        "equinox",
        "orbax.checkpoint",
        "ruff",
        "mypy",
        "mkdocs",
        "material",  # mkdocs-material
        "mkdocstrings",
        "mkdocstrings_handlers.python",
        "griffe",
        "mkdocs_jupyter",
    ):
        try:
            mods[name] = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every failure
            problems.append(f"import {name} failed: {type(e).__name__}: {e}")
    jax = mods.get("jax")
    if jax is not None and not jax.__version__.startswith(("0.10.", "0.11.", "0.12.")):
        problems.append(f"jax {jax.__version__} installed; jaxsync supports jax 0.10-0.12")
    m4j = mods.get("mpi4jax")
    if m4j is not None and not m4j.__version__.startswith("0.9."):
        problems.append(f"mpi4jax {m4j.__version__} installed; jaxsync pins 0.9.*")
    js = mods.get("jaxsync")
    if js is not None:
        where = pathlib.Path(js.__file__).resolve().parent.parent
        if where != pathlib.Path(checkout).resolve():
            problems.append(
                f"import jaxsync gives {js.__file__}, not the checkout "
                f"{checkout}: reinstall with pip install -e {checkout}"
            )
    if js is not None:
        from jaxsync._comm import _mpi_load

        status = _mpi_load.native_status()
        if not status["loaded"]:
            problems.append(f"jaxsync's native MPI target: {status['error']}")
    mpirun = pathlib.Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        problems.append(f"{mpirun} is missing: pip install 'mpich>=4'")
    if m4j is not None:
        bridge = pathlib.Path(m4j.__file__).parent / "_src" / "xla_bridge"
        built = [k for k in ("cpu", "cuda") if list(bridge.glob(f"mpi_xla_bridge_{k}*.so"))]
        want = ["cpu"] + (["cuda"] if os.environ.get("JAXSYNC_CUDA") else [])
        for k in want:
            if k not in built:
                problems.append(
                    f"mpi4jax's {k.upper()} bridge was not built (have: "
                    f"{built or 'none'}); see the mpi4jax step in setup.log"
                )
    else:
        built = []
    if problems:
        print("[setup] the install is incomplete:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(
        f"[setup] ok: jax {jax.__version__}, optax {mods['optax'].__version__}, "
        f"mpi4py {mods['mpi4py'].__version__}, mpi4jax {m4j.__version__} "
        f"(bridges: {', '.join(built)}), jaxsync from {checkout} with its native MPI "
        f"target ({status['mpi_library']})"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
