"""An emulated multi-host cluster on one Linux machine: ``python -m jaxsync cluster``.

For tests, the benchmark, and trying multi-host code before renting hosts. Each
host is a Linux network namespace on a bridge, with its link shaped by ``tc tbf``;
the program runs under MPICH's ``mpirun`` across the hosts (TCP between hosts,
shared memory within one), with faults to inject: a host's link down for a while
or for good, one host's link slower than the others. A fault may follow the
program rather than the clock: ``LinkDown(host=1, after="step-3", duration=2.0)``
takes the link down when a rank first calls ``jaxsync.cluster.mark("step-3")``.
No root is needed where the kernel allows unprivileged user namespaces;
everything it makes lives in namespaces of its own, gone when the run ends
however it ends, and nothing is sent outside them.

Example:
  >>> import sys, jaxsync.cluster
  >>> r = jaxsync.cluster.run(
  ...     [sys.executable, "-c", "import os; print(os.environ['JAXSYNC_CLUSTER_HOST'])"],
  ...     hosts=2, procs_per_host=2, link="1gbit", timeout=60)
  >>> r.returncode, sorted(x for x in r.output.splitlines() if not x.startswith("[cluster]"))
  (0, ['[host0 r0] 0', '[host0 r1] 0', '[host1 r2] 1', '[host1 r3] 1'])
"""

from ._run import ClusterResult, ClusterUnavailable, check, run
from ._spec import LinkDown, mark, parse_rate

__all__ = [
    "ClusterResult",
    "ClusterUnavailable",
    "LinkDown",
    "check",
    "mark",
    "parse_rate",
    "run",
]
