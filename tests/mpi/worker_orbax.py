"""tests/test_orbax.py's round trip of every jaxsync state, on each rank under mpirun.

Each rank trains on its own data, saves into ``--ckpt DIR/rank{R}/NAME`` (the rank from
``jaxsync.topology()``: orbax sees process 0 on every rank) and restores from it; it
records what matched and digests of its per-replica and replicated leaves, and, after
a barrier, what the checkpoint directory holds.
"""

import os
import sys
from pathlib import Path

from _worker import Results, init

ROOT = Path(__file__).resolve().parents[2]


def main():
    ns, jax, MPI = init([(("--ckpt",), {"required": True})])
    sys.path.insert(0, str(ROOT / "tests"))
    from test_orbax import AXIS, CASES, roundtrip

    import jaxsync

    topo = jaxsync.topology()
    res = Results(ns.out, topo.rank)
    mesh = jax.make_mesh((jax.local_device_count(),), (AXIS,))
    res.add("rank_size", (topo.rank, topo.size, jax.process_index()))
    res.add("cases", {name: roundtrip(name, mesh, topo.rank, Path(ns.ckpt)) for name in CASES})
    MPI.COMM_WORLD.Barrier()
    res.add("dirs", sorted(os.listdir(ns.ckpt)))
    res.add("mine", sorted(os.listdir(Path(ns.ckpt) / f"rank{topo.rank}")))
    res.write()


if __name__ == "__main__":
    main()
