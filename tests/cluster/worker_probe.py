"""Where a rank is: prints one JSON line (rank, hostname, topology, pid, net namespace).

``--sleep S`` then sleeps (for the time-limit and Ctrl-C tests); ``--exit-rank R
--code C`` makes rank R exit with status C. Each rank writes ``OUT/rank{R}.pid``
first (its PID and network namespaces), so a test can check afterwards that no
process of the run is left.
"""

import argparse
import json
import os
import socket
import time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--exit-rank", type=int, default=-1)
p.add_argument("--code", type=int, default=0)
ns = p.parse_args()

from mpi4py import MPI  # noqa: E402

rank = MPI.COMM_WORLD.Get_rank()
with open(os.path.join(ns.out, f"rank{rank}.pid"), "w") as f:
    f.write(" ".join(os.readlink(f"/proc/self/ns/{k}") for k in ("pid", "net")) + "\n")

import jaxsync  # noqa: E402

t = jaxsync.topology(MPI.COMM_WORLD)
print(
    json.dumps(
        dict(
            rank=rank,
            hostname=socket.gethostname(),
            host=t.host,
            hosts=t.hosts,
            local_rank=t.local_rank,
            local_size=t.local_size,
            size=t.size,
            devices=t.local_devices,
            env_host=os.environ.get("JAXSYNC_CLUSTER_HOST"),
        )
    ),
    flush=True,
)
if ns.sleep:
    time.sleep(ns.sleep)
if rank == ns.exit_rank:
    raise SystemExit(ns.code)
