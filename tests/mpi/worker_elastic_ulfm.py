"""ULFM from mpi4py (Open MPI 5, ``mpirun --with-ft ulfm``): one rank is killed,
the survivors see the failure, revoke, shrink, sum on the shrunk world and agree.

Run by tests/mpi/test_elastic_ulfm.py with the ft environment's python (no jax):
    mpirun --with-ft ulfm -n 3 python worker_elastic_ulfm.py OUT_DIR
Rank ``size - 1`` kills itself (SIGKILL) after the first sum: chosen by the
program's progress, not the clock. Each survivor writes OUT_DIR/rank-R.json with
what it saw and how long each part took, then leaves without MPI_Finalize.
"""

import json
import os
import signal
import sys
import time

from mpi4py import MPI

out = sys.argv[1]
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
victim = size - 1
rec = {"rank": rank, "size": size, "library": MPI.Get_library_version().split(",")[0]}
rec["first_sum"] = world.allreduce(rank + 1)  # everyone alive: 1 + ... + size
if rank == victim:
    os.kill(os.getpid(), signal.SIGKILL)

t0 = time.perf_counter()
try:
    while True:  # until the failure is seen (a sum may complete before it is)
        world.allreduce(1)
except MPI.Exception as e:
    rec["error"] = MPI.Get_error_string(e.Get_error_class())
    rec["error_class"] = {
        MPI.ERR_PROC_FAILED: "MPI_ERR_PROC_FAILED",
        MPI.ERR_REVOKED: "MPI_ERR_REVOKED",
    }.get(e.Get_error_class(), str(e.Get_error_class()))
t1 = time.perf_counter()
world.Revoke()
t2 = time.perf_counter()
shrunk = world.Shrink()
t3 = time.perf_counter()
rec["shrunk_size"] = shrunk.Get_size()
rec["shrunk_rank"] = shrunk.Get_rank()
rec["sum_on_survivors"] = shrunk.allreduce(2 ** shrunk.Get_rank())  # 1 + 2 = 3 on 2 ranks
t4 = time.perf_counter()
rec["agreed"] = shrunk.Agree(1 if rank == 0 else 3)  # a bitwise AND: 1 & 3 = 1
t5 = time.perf_counter()
rec["seconds"] = {
    "detect": t1 - t0,
    "revoke": t2 - t1,
    "shrink": t3 - t2,
    "sum": t4 - t3,
    "agree": t5 - t4,
}
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(rec, f)
shrunk.Barrier()
# No MPI_Finalize: after a failure it hung in 2 of ~17 runs here (Open MPI 5.0.11,
# mpirun waiting after every record was written); a recovered job leaves so too.
sys.stdout.flush()
os._exit(0)
