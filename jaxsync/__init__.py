"""jaxsync: gradient synchronisation for data-parallel JAX training.

Pack a gradient pytree into a few contiguous buffers, reduce them over the mesh
axes of a process with XLA collectives and across processes with MPI (jaxsync's
own XLA FFI targets on CPU, mpi4jax's on GPU) or a mesh axis, and unpack. Each strategy is an optax
``GradientTransformation``::

    tx = optax.chain(jaxsync.hierarchical_mean(axis_name="local"), optax.adam(1e-3))
"""

from jaxsync._comm._axis_backend import AxisComm
from jaxsync._comm._host import host_allocator_state, tune_host_allocator
from jaxsync._comm._timeline import Timeline, start_from_env, timeline
from jaxsync._comm._topology import Topology, default_comm, free_communicators, topology
from jaxsync._core._accumulate import AccumulateState, accumulate
from jaxsync._core._batch import local_batch
from jaxsync._core._broadcast import broadcast_params
from jaxsync._core._finite import apply_if_finite, skip_not_finite
from jaxsync._core._join import WeightedState, all_done
from jaxsync._core._options import SyncOptions
from jaxsync._core._plan import Bucket, LeafSpec, Plan, make_plan
from jaxsync._core._quant import Quantized
from jaxsync._core._quantsum import QuantState
from jaxsync._core._replica import replica_mean
from jaxsync._core._sync import DoubleBufferState, SyncState, sync_gradients
from jaxsync._core._transforms import (
    flat_mean,
    hierarchical_mean,
    mean,
    naive_mean,
    single_node_mean,
    two_dimensional_mean,
)
from jaxsync._core._wire import WireFormat, wire_formats

# The optional areas (each registers with the core when imported).
from jaxsync.auto import auto_mean, save_tree_spec
from jaxsync.compress import PowerSGDState, SignState, powersgd_mean, sign_mean, state_specs
from jaxsync.local import (
    BMUFState,
    Islands,
    LocalUpdatesState,
    bmuf,
    diloco,
    islands,
    local_sgd,
)
from jaxsync.sparse import (
    RowSparse,
    SparseOptions,
    apply_sparse_updates,
    densify,
    row_sparse_grad,
    sparse_adagrad,
    sparse_sgd,
)
from jaxsync.zero import (
    ShardedState,
    clip_by_global_norm,
    gather_state,
    reshard_state,
    shard_state,
    sharded,
    state_shapes,
)

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "AxisComm",
    "accumulate",
    "apply_if_finite",
    "auto_mean",
    "BMUFState",
    "bmuf",
    "diloco",
    "Islands",
    "islands",
    "local_sgd",
    "LocalUpdatesState",
    "Bucket",
    "LeafSpec",
    "Plan",
    "PowerSGDState",
    "Quantized",
    "QuantState",
    "RowSparse",
    "ShardedState",
    "SignState",
    "SparseOptions",
    "DoubleBufferState",
    "WeightedState",
    "all_done",
    "SyncOptions",
    "WireFormat",
    "wire_formats",
    "SyncState",
    "Timeline",
    "Topology",
    "apply_sparse_updates",
    "broadcast_params",
    "clip_by_global_norm",
    "default_comm",
    "densify",
    "flat_mean",
    "free_communicators",
    "gather_state",
    "hierarchical_mean",
    "host_allocator_state",
    "local_batch",
    "make_plan",
    "mean",
    "naive_mean",
    "powersgd_mean",
    "replica_mean",
    "reshard_state",
    "row_sparse_grad",
    "shard_state",
    "sharded",
    "sign_mean",
    "single_node_mean",
    "skip_not_finite",
    "sparse_adagrad",
    "sparse_sgd",
    "state_shapes",
    "state_specs",
    "sync_gradients",
    "timeline",
    "topology",
    "tune_host_allocator",
    "two_dimensional_mean",
    "save_tree_spec",
]

start_from_env()  # JAXSYNC_TIMELINE=DIR: the whole run's timeline, written at exit
