"""Benchmark: jaxsync's strategies against the obvious ways to average gradients.

This package uses jaxsync only through its public API (``import jaxsync``), so it
is also an example of using it; the one exception is ``compress``, which reads the
compressors' private leaf layouts and the cost model (see its docstring).

``python -m jaxsync bench`` (or ``python -m jaxsync.bench``) measures, for a few
gradient trees, the *marginal* cost of a synchronisation inside a jitted training
step::

    marginal = time(step with sync) - time(same step without sync)

where the step also does a cheap fake gradient computation on every leaf
(``g * 1.0001 + 1``), so the sync competes for memory bandwidth as it does in a
real step. Every case of a tree is timed once per round, rounds are repeated
and interleaved, and the marginal is taken per round against the base step of
the same round, so the ratios are measured side by side on a noisy machine.

Two modes:

* **intra** (one process, ``--devices`` fake CPU devices, default 8): inside
  ``jit(shard_map)`` over a 1-D mesh ``"d"``, jaxsync's strategies (``comm=None``)
  against per-leaf ``lax.pmean``, one ``lax.pmean`` of the whole tree and
  ``ravel_pytree`` + ``pmean``; the limit is ``psum`` of one preallocated f32
  buffer of the same bytes, in the same kind of step.
* **mpi** (under ``mpirun -n P``, ``--devices`` per process, default 1): the
  README's step, ``jit(shard_map)`` over the local devices with
  ``axis_name="local"`` and ``comm=MPI.COMM_WORLD`` (also ``comm_dtype=bfloat16``),
  and a whole train step (gradients, ``hierarchical_mean``, Adam) against the same
  step without the sync. With one device per process, the plain-``jit`` path
  (``axis_name=None``, rows ``(jit)``, also ``staging="host"``) and the peers run
  beside it: per-leaf ``mpi4jax.allreduce``, ``ravel_pytree`` + one
  ``mpi4jax.allreduce`` and per-leaf ``np.asarray`` + ``mpi4py`` ``Allreduce``.
  The limit is a bare ``mpi4py`` ``Allreduce`` of preallocated numpy buffers of the
  same bytes (a raw time, no step), out of place, with the in-place
  (``MPI.IN_PLACE``) one beside it; with several devices, ``psum bare`` is the
  intra-process limit. The row ``mpi4jax bare`` (one ``mpi4jax.allreduce`` of such
  a buffer inside a jitted step) tells the cost of MPI from the cost of calling it
  from XLA. mpi4jax and mpi4py have no bfloat16 type: those peers send 16-bit
  leaves as float32 (``ravel_pytree`` promotes them anyway). Every sample is the
  slowest rank's (a step is done when the slowest process is).

``hierarchical`` is the default strategy (``hierarchical_mean`` with default
options); ``hierarchical bf16`` adds ``comm_dtype=bfloat16``. On the ResNet-like
and 500-leaf trees, ``flat`` is also swept over ``bucket_bytes`` (with
``pack_threshold=None``) and ``pack_threshold``; configs that give the same
packing plan as one already measured are skipped (listed in the JSON).
Programs are compiled once per distinct HLO; cases sharing a program (same
``program`` hash in the JSON) are still timed separately, which shows the noise.

The device count must be set before JAX initialises its backends: ``main``
does it from ``--devices`` (``jax_num_cpu_devices``); when JAX is already
initialised (e.g. by the caller) with another count, it stops with an error
saying so (set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` instead).

"Wire bytes" are modelled: what each replica sends under bandwidth-optimal
algorithms, counted from the step's jaxpr (allreduce ``2(p-1)/p·B``,
reduce-scatter and all-to-all ``(p-1)/p·B``, all-gather ``(p-1)·b``).

The host allocator is left as glibc sets it, as in a user's program;
``--tune-host-allocator`` calls ``jaxsync.tune_host_allocator()`` first (XLA
allocates a step's large buffers afresh on every call, and with glibc's defaults
their pages fault in again each time: the "faults" column). It applies to jaxsync
and the peers alike.

Results go to ``--out`` (default ``bench-results/``): ``<mode>.json``,
``<mode>.csv`` and ``<mode>.png``; a table and PASS/MISS lines for the targets
are printed. Only rank 0 prints or writes.

Modules (each may import only those above it, plus jax/numpy/mpi4py/mpi4jax/optax
and ``jaxsync``'s public API; each docstring says what it may import):

* ``trees``: the gradient trees; ``hlo``: collectives counted in a step's jaxpr
  and HLO; ``timing``: ``Case``, compiling, timing, the slowest rank, ``Row``;
* ``methods``: jaxsync's strategies as ``tree -> tree`` functions, the sweep;
  ``peers``: the peers; ``cases``: the cases of one tree (``IntraBench``,
  ``MPIBench``); ``world``: the communicator and device count;
* ``report``: targets, table, JSON/CSV/PNG; ``cli``: ``python -m jaxsync bench``;
* other suites (``--suite NAME``): ``sparse``, ``compress``; and ``demo``
  (``python -m jaxsync demo``), which uses the public API only.
"""


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxsync bench [options]``; returns the exit status."""
    from .cli import main as run

    return run(argv)
