"""A docs page's code as one script under mpirun (as the pages say to run them).

``--page docs/NAME.md``: its runnable ```python blocks (as tests/test_docs.py finds
them) run in order in one namespace; the first block's 8 CPU devices become
``--devices``. ``--record a,b``: after the last block, each rank records the leaves of
those names (numpy arrays) for the pytest side to compare across ranks.
"""

import sys
from pathlib import Path

from _worker import Results, init

ROOT = Path(__file__).resolve().parents[2]


def main():
    ns, jax, MPI = init([(("--page",), {"required": True}), (("--record",), {"default": ""})])
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    from test_docs import runnable

    page = ROOT / ns.page
    line = 'jax.config.update("jax_num_cpu_devices", 8)'
    mine = f'jax.config.update("jax_num_cpu_devices", {ns.devices})'
    env = {"__name__": "__main__"}
    blocks = runnable(page)
    assert blocks and line in blocks[0].source, f"{ns.page}: no 8-device first block"
    for b in blocks:
        src = b.source.replace(line, mine)
        exec(compile("\n" * (b.line - 1) + src, str(page), "exec"), env)
    res = Results(ns.out, MPI.COMM_WORLD.Get_rank())
    res.add("devices", jax.local_device_count())
    for name in filter(None, ns.record.split(",")):
        res.add(name, [np.asarray(x) for x in jax.tree.leaves(env[name])])
    res.write()


if __name__ == "__main__":
    main()
