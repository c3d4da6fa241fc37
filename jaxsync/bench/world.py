"""Where the bench runs: the MPI communicator (if any) and the CPU device count.

What it is for: every suite's first two calls. ``mpi_world`` is the communicator
``comm="auto"`` picks (``MPI.COMM_WORLD`` when launched by MPI with several
processes, else ``None``): the bench's mode switch, taken before JAX starts.
``set_devices`` asks for the fake CPU devices, which must happen before JAX
initialises its backends.
What it may import: jax, the standard library, ``jaxsync.default_comm`` and
``jaxsync._comm._topology.set_cpu_devices`` (the same ``--devices`` as tune's).

Example:
  >>> from jaxsync.bench import world
  >>> world.mpi_world() is None  # run alone, not under mpirun
  True
  >>> world.set_devices(8)  # what the doctests already have: no error
"""

from __future__ import annotations


def mpi_world():
    """``MPI.COMM_WORLD`` when started by an MPI launcher with several processes.

    Raises:
      jaxsync's ``LaunchError`` (a ``RuntimeError``): the launcher says there are
        several processes but MPI sees one (mpi4py built against another MPI).
    """
    import jaxsync

    return jaxsync.default_comm()


def set_devices(n: int) -> None:
    """Ask for ``n`` CPU devices; must happen before JAX initialises its backends."""
    from jaxsync._comm._topology import set_cpu_devices

    set_cpu_devices(n, "bench")
