"""Shared set-up for the MPI worker scripts (run under ``mpirun``, not pytest).

A worker is started as ``python WORKER.py --out DIR --devices N [args]``. It
must call :func:`init` before anything initialises JAX; it records results
with :func:`Results.add` and writes them with :func:`Results.write` as
``DIR/rank{R}.pkl`` (a dict of plain numpy arrays / Python values) that
``test_mpi.py`` loads and asserts on. :func:`start` does :func:`init` and
the set-up every worker then repeats: the world communicator, this rank, the
size, the local device count and the :class:`Results`; :func:`local_mesh` is
the one-axis mesh over this process's devices, :func:`inter_factories` the
strategies a worker runs across processes.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading
from typing import Any, NamedTuple


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


class World(NamedTuple):
    """What :func:`start` returns: a worker's arguments, JAX and its MPI world."""

    ns: argparse.Namespace
    jax: Any
    comm: Any  # MPI.COMM_WORLD
    rank: int
    size: int
    devices: int  # jax.local_device_count()
    res: Results


def start(extra_args=None) -> World:
    """:func:`init`, then ``MPI.COMM_WORLD``, its rank and size, the local device
    count and this rank's :class:`Results`."""
    ns, jax, MPI = init(extra_args)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    return World(
        ns, jax, comm, rank, comm.Get_size(), jax.local_device_count(), Results(ns.out, rank)
    )


def local_mesh(axis="d"):
    """A one-axis mesh named ``axis`` over this process's devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.local_devices()), (axis,))


def inter_factories():
    """The factories of the strategies with an inter-process stage, by name."""
    import jaxsync

    return dict(
        naive=jaxsync.naive_mean,
        flat=jaxsync.flat_mean,
        hierarchical=jaxsync.hierarchical_mean,
        two_dimensional=jaxsync.two_dimensional_mean,
    )


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
