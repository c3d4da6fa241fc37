"""The collectives and the inter-process stage, below the strategies.

``_intra`` (XLA collectives over the mesh axes of a process) and ``_invariance``
(how results are typed over those axes); ``_topology`` (ranks, hosts, the
communicators jaxsync duplicates); the inter-process backends: ``_mpi_backend``
(MPI: ``_mpi_ops`` over jaxsync's native FFI target ``_native`` via
``_native_prim``, or mpi4jax via ``_mpi4jax_prim``, ``_mpi_load`` finds both),
``_axis_backend`` (a mesh axis of JAX's own multi-process runtime) and
``_host_tier`` (processes that share a host); ``_ordering`` (a token chain keeps
every process's MPI calls in one order), ``_async`` (asynchronous native sums),
``_agree`` (the processes compare what they are about to run), ``_watchdog`` and
``_quiet`` (stalls, and exiting with calls in flight), ``_host`` (host allocator).
Nothing here imports ``jaxsync._core`` or an optional area.
"""
