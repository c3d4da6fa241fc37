"""A program that is slow to reach its marker, and watches its own host's link.

Rank ``--rank`` (the others end at once) sleeps ``--delay`` seconds (a slow
start-up), notes whether its host's link is up, calls
``jaxsync.cluster.mark(--marker)``, then watches its link's carrier
(``/sys/class/net/eth0/carrier`` in its host's network namespace) until it goes
down and comes back, for at most ``--limit`` seconds. Prints one JSON line, on the
cluster's clock (``$JAXSYNC_CLUSTER_T0``): when it marked, whether the link was up
then, and when it saw the link go down and come up (null: not seen).
"""

import argparse
import json
import os
import time

import jaxsync.cluster

p = argparse.ArgumentParser()
p.add_argument("--rank", type=int, default=1)
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--marker", default="go")
p.add_argument("--limit", type=float, default=60.0)
ns = p.parse_args()
if int(os.environ["PMI_RANK"]) != ns.rank:
    raise SystemExit(0)
t0 = float(os.environ["JAXSYNC_CLUSTER_T0"])


def link_up() -> bool:
    with open("/sys/class/net/eth0/carrier") as f:
        return f.read().strip() == "1"


def seen(up: bool, deadline: float) -> float | None:
    while time.time() < deadline:
        if link_up() == up:
            return time.time() - t0
        time.sleep(0.01)
    return None


time.sleep(ns.delay)
up_at_mark = link_up()
marked = time.time() - t0
jaxsync.cluster.mark(ns.marker)
deadline = time.time() + ns.limit
down = seen(False, deadline)
up = seen(True, deadline) if down is not None else None
print(json.dumps(dict(marked=marked, up_at_mark=up_at_mark, down=down, up=up)), flush=True)
