"""A Slurm of two nodes on the emulated cluster: a slurmd on each host.

    python -m jaxsync cluster --hosts 2 --no-launch --no-user-namespace \
        [--lose-host 1@lose] -- python worker_cluster.py SCENARIO DIR

Runs once, in the cluster's switch namespace (``--no-launch``; without a user
namespace: slurmctld calls ``setgroups``, which one refuses): munged and slurmctld
there, listening on the switch's address, and one slurmd per host, started in that
host's namespace (its own network and hostname, ``hostH``) through
``$JAXSYNC_CLUSTER_SSH``. Then the SCENARIO, its commands' outputs written to
DIR/SCENARIO.json for the test to check:

- ``train``: ``srun -N 2 -n 2`` of worker_topology.py (into DIR/topology) and of
  worker_train.py (into DIR/train): one task per node.
- ``lose``: ``salloc -N 2 -n 2 --no-kill`` of the restarting supervisor over
  worker_train.py ``--lose-at 3`` (into DIR/train); the cluster loses host 1 whole at
  that step (``--lose-host 1@lose``: its link down, every process on it - slurmd,
  slurmstepd, the rank - killed), Slurm declares the node down after its
  SlurmdTimeout, and the supervisor restarts on the node left.
"""

import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: slurm_harness's _harness
from slurm_harness import HERE, PYTHON, Node, Slurm  # noqa: E402

from jaxsync.cluster._spec import SUBNET, Spec  # noqa: E402

SCENARIO, OUT = sys.argv[1], Path(sys.argv[2])
spec = Spec.from_json(os.environ["JAXSYNC_CLUSTER"])
SSH = os.environ["JAXSYNC_CLUSTER_SSH"]
# MPICH over libfabric's tcp provider on the host's link: with its UCX netmod (the
# default) Slurm 22.05's pmi2 mangles the long addresses MPICH exchanges, and MPI_Init
# failed (or hung) in about 2 starts of 5 across two nodes here; with ofi, none of 14.
# docs/launching.md gives the same advice.
ENV = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    "PATH": os.pathsep.join([os.path.dirname(PYTHON), os.environ.get("PATH", "")]),
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "eth0",
}


def _cgroups() -> str:
    """Shell lines giving a host's mount namespace a /sys/fs/cgroup: ``ip netns exec``
    mounts a fresh sysfs without one, and slurmd (22.05) will not start without its
    cgroup plugin (proctrack/linuxproc and task/none use none of it). cgroup v2 where
    the machine has it, else a tmpfs with the named systemd hierarchy (v1)."""
    mounts = Path("/proc/self/mounts").read_text().split("\n")
    if any(line.split()[1:3] == ["/sys/fs/cgroup", "cgroup2"] for line in mounts if line):
        return "mount -t cgroup2 none /sys/fs/cgroup"
    return (
        "mount -t tmpfs jaxsync-cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
        "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd"
    )


def on_host(h: int):
    # the ssh stand-in runs a command with ';' as a script, in host h's namespace
    return lambda slurmd: [SSH, f"host{h}", f"{_cgroups()}; exec {shlex.join(slurmd)}"]


def record(name, r) -> dict:
    return {"name": name, "returncode": r.returncode, "timed_out": r.timed_out, "output": r.output}


nodes = [Node(f"host{h}", spec.address(h), f"host{h}", on_host(h)) for h in range(spec.hosts)]
# SlurmdTimeout 10 s: a lost node is declared down (and its step ended) 10-20 s after
slurm = Slurm(nodes=nodes, controller=f"{SUBNET}.1", slurmd_timeout=10)
results = []
try:
    slurm.start(timeout=90)
    srun = ["srun", "-N", "2", "-n", "2", "--kill-on-bad-exit=1", "--mpi=pmi2"]
    if SCENARIO == "train":
        (OUT / "topology").mkdir()
        (OUT / "train").mkdir()
        cmd = [*srun, PYTHON, HERE / "worker_topology.py", OUT / "topology"]
        results.append(record("topology", slurm.run(cmd, 90, ENV)))
        cmd = [*srun, PYTHON, HERE / "worker_train.py", OUT / "train"]
        results.append(record("train", slurm.run(cmd, 90, ENV)))
    elif SCENARIO == "lose":
        (OUT / "train").mkdir()
        supervise = [
            PYTHON, "-m", "jaxsync", "elastic", "--min-np", "1", "--max-np", "2",
            "--max-restarts", "3", "--mpirun", "srun", "--",
            PYTHON, HERE / "worker_train.py", OUT / "train", "--lose-at", "3",
        ]  # fmt: skip
        cmd = ["salloc", "-N", "2", "-n", "2", "--no-kill", "--time=5", "--quiet", *supervise]
        results.append(record("supervise", slurm.run(cmd, 180, ENV)))
        results.append({"name": "states", "states": slurm.states()})
    else:
        raise SystemExit(f"worker_cluster.py: no scenario {SCENARIO!r} (train, lose)")
except BaseException as e:
    results.append({"name": "error", "error": repr(e), "logs": slurm.tail()})
    raise
finally:
    slurm.stop()
    (OUT / f"{SCENARIO}.json").write_text(json.dumps(results, default=str))
