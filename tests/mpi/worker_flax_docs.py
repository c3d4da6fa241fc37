"""docs/flax.md's blocks as one training script under mpirun (as the page says to run it).

The page's first block asks for 8 CPU devices; here each process gets ``--devices``
instead. Every block runs in order in one namespace; each rank records the values the
page computes (metrics, loss, the synchronisations counted) for the pytest side to
compare across ranks.
"""

import sys
from pathlib import Path

from _worker import Results, init, to_numpy

ROOT = Path(__file__).resolve().parents[2]


def main():
    ns, jax, MPI = init()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_flax_docs import PAGE, blocks

    res = Results(ns.out, MPI.COMM_WORLD.Get_rank())
    line = 'jax.config.update("jax_num_cpu_devices", 8)'
    mine = f'jax.config.update("jax_num_cpu_devices", {ns.devices})'
    env = {"__name__": "__main__"}
    for b in blocks(PAGE.read_text()):
        if b["run"]:
            src = b["source"].replace(line, mine)
            exec(compile("\n" * (b["line"] - 1) + src, str(PAGE), "exec"), env)
    res.add("rank_size", (env["RANK"], env["SIZE"]))
    res.add("metrics", to_numpy(env["metrics"]))
    res.add("test_accuracy", env["test_accuracy"])
    res.add("loss", float(env["loss"]))
    res.add("calls", len(env["calls"]))
    res.add("devices", env["DEVICES"])
    res.write()


if __name__ == "__main__":
    main()
