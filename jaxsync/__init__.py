"""jaxsync: gradient synchronisation for data-parallel JAX training.

Pack a gradient pytree into a few contiguous buffers, reduce them over the mesh
axes of a process with XLA collectives and across processes with MPI (jaxsync's
own XLA FFI targets on CPU, mpi4jax's on GPU) or a mesh axis, and unpack. Each strategy is an optax
``GradientTransformation``::

    tx = optax.chain(jaxsync.hierarchical_mean(axis_name="local"), optax.adam(1e-3))
"""

from ._auto import auto_mean
from ._axis_backend import AxisComm
from ._broadcast import broadcast_params
from ._compress import PowerSGDState, SignState, state_specs
from ._host import host_allocator_state, tune_host_allocator
from ._plan import Bucket, LeafSpec, Plan, make_plan
from ._powersgd import powersgd_mean
from ._sign import sign_mean
from ._sparse import RowSparse, SparseOptions
from ._sparse_grad import row_sparse_grad
from ._sparse_optim import apply_sparse_updates, densify, sparse_adagrad, sparse_sgd
from ._sparse_sync import sync_mixed as _sync_mixed  # noqa: F401 (registers RowSparse)
from ._sync import DoubleBufferState, SyncState, sync_gradients
from ._topology import Topology, default_comm, free_communicators, topology
from ._transforms import (
    flat_mean,
    hierarchical_mean,
    naive_mean,
    single_node_mean,
    two_dimensional_mean,
)

__version__ = "0.1.0"

__all__ = [
    "AxisComm",
    "auto_mean",
    "Bucket",
    "LeafSpec",
    "Plan",
    "PowerSGDState",
    "RowSparse",
    "SignState",
    "SparseOptions",
    "DoubleBufferState",
    "SyncState",
    "Topology",
    "apply_sparse_updates",
    "broadcast_params",
    "default_comm",
    "densify",
    "flat_mean",
    "free_communicators",
    "hierarchical_mean",
    "host_allocator_state",
    "make_plan",
    "naive_mean",
    "powersgd_mean",
    "row_sparse_grad",
    "sign_mean",
    "single_node_mean",
    "sparse_adagrad",
    "sparse_sgd",
    "state_specs",
    "sync_gradients",
    "topology",
    "tune_host_allocator",
    "two_dimensional_mean",
]
