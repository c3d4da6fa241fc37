"""The workers' start: two processes of 2 CPU devices joined by jax.distributed (gloo).

A worker runs as ``python WORKER PROCESS_ID PORT RESULTS`` (see ``_launch.py``); it
calls :func:`join` before anything else initialises JAX, then :func:`replicas` for
the ``(host, local)`` mesh of the 4 replicas.
"""

import sys


def join():
    """Parse ``PROCESS_ID PORT RESULTS`` and join the runtime: ``(jax, pid, results)``,
    ``results`` the RESULTS file opened for writing (closed at exit)."""
    pid, port = int(sys.argv[1]), sys.argv[2]
    results = open(sys.argv[3], "w")  # noqa: SIM115 (closed at exit)
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=pid,
        initialization_timeout=60,
    )
    return jax, pid, results


def replicas(dtype):
    """The ``(host, local)`` 2 x 2 mesh and a global array of the 4 replicas' ids
    (``dtype``), replica ``r`` holding ``r``."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("host", "local"))
    sharding = NamedSharding(mesh, P(("host", "local")))
    ids = jax.make_array_from_callback((4,), sharding, lambda idx: np.arange(4, dtype=dtype)[idx])
    return mesh, ids
