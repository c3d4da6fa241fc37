"""Old home of the benchmark, kept only for modules not yet moved into ``jaxsync.bench``.

The benchmark lives in ``jaxsync/bench/`` (``python -m jaxsync bench``). This module
re-exports the names that ``_bench_model.py``, ``_tune.py``, ``_auto.py`` and
``scripts/measure_native.py`` still import from here; delete it once they import
from ``jaxsync.bench`` (and ``_bench_model``/``_tune`` have moved there).
May import: ``jaxsync.bench`` only.
"""

from .bench.cases import IntraBench, MPIBench
from .bench.cli import main
from .bench.methods import AXIS, LOCAL, fake_grads
from .bench.timing import Case, compile_cases, run_tree
from .bench.trees import make_trees, resnet18_like, small_leaves, tree_info
from .bench.world import mpi_world as _mpi_world
from .bench.world import set_devices as _set_devices

__all__ = ["AXIS", "LOCAL", "Case", "IntraBench", "MPIBench", "_mpi_world", "_set_devices",
           "compile_cases", "fake_grads", "main", "make_trees", "resnet18_like",
           "run_tree", "small_leaves", "tree_info"]
