"""Under ``srun --mpi=pmi2``: this rank's ``jaxsync.topology()`` beside Slurm's variables.

    srun -n 2 --mpi=pmi2 python worker_topology.py DIR

Each rank writes DIR/rank{SLURM_PROCID}.json: the topology's fields, the SLURM_*
variables that say the same (rank, task count, node index and count, local rank), the
PMI ones srun's pmi2 plugin set, and its hostname.
"""

import dataclasses
import json
import os
import socket
import sys

import jaxsync

t = jaxsync.topology()
env = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "PMI_"))}
out = {"topology": dataclasses.asdict(t), "env": env, "hostname": socket.gethostname()}
with open(os.path.join(sys.argv[1], f"rank{os.environ['SLURM_PROCID']}.json"), "w") as f:
    json.dump(out, f)
