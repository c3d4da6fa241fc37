"""Shared set-up for the MPI worker scripts (run under ``mpirun``, not pytest).

A worker is started as ``python WORKER.py --out DIR --devices N [args]``. It
must call :func:`init` before anything initialises JAX; it records results
with :func:`Results.add` and writes them with :func:`Results.write` as
``DIR/rank{R}.pkl`` (a dict of plain numpy arrays / Python values) that
``test_mpi.py`` loads and asserts on.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading


def init(extra_args=None):
    """Parse the common arguments, set the device count, import JAX and MPI."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument(
        "--devices",
        default="1",
        help="local devices per process, or a comma list: one count per rank",
    )
    p.add_argument(
        "--watchdog",
        type=float,
        default=0.0,
        help="exit with code 124 after this many seconds (0: off)",
    )
    for args, kwargs in extra_args or []:
        p.add_argument(*args, **kwargs)
    ns = p.parse_args()
    from mpi4py import MPI  # does not initialise JAX

    counts = [int(c) for c in ns.devices.split(",")]
    ns.devices = counts[MPI.COMM_WORLD.Get_rank() % len(counts)]
    import jax

    jax.config.update("jax_num_cpu_devices", ns.devices)
    if ns.watchdog:
        arm_watchdog(ns.watchdog)
    return ns, jax, MPI


def arm_watchdog(seconds):
    """Exit this rank with code 124 if it is still running after ``seconds``."""

    def fire():
        sys.stderr.write(f"watchdog: rank still running after {seconds} s, exiting 124\n")
        sys.stderr.flush()
        os._exit(124)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


class Results:
    def __init__(self, out, rank):
        self.out = out
        self.rank = rank
        self.data = {}

    def add(self, key, value):
        assert key not in self.data, key
        self.data[key] = value

    def write(self):
        path = os.path.join(self.out, f"rank{self.rank}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(self.data, f)
        os.replace(path + ".tmp", path)


def to_numpy(tree):
    """A pytree of jax arrays -> the same pytree of numpy arrays (dtypes kept)."""
    import jax
    import numpy as np

    return jax.tree_util.tree_map(lambda x: np.asarray(x), tree)
