"""``python -m jaxsync tune --quick`` inside the emulated cluster (2 hosts x 1
process at 1 Gb/s): the profile records the topology and a measured network
link, which no physics lets run faster than the shaped rate."""

import json
import sys

from cluster_harness import worker_env

from jaxsync.auto._cost import Profile

RATE = 1e9  # --link 1gbit
BURST = max(128 * 1024, int(RATE / 8 * 0.002))  # tbf's bucket (jaxsync.cluster._inside.tbf)


def test_tune_quick_measures_the_network_link(cluster, tmp_path):
    out = tmp_path / "profile.json"
    r = cluster.run(
        [sys.executable, "-m", "jaxsync", "tune", "--quick", "--out", str(out)],
        hosts=2,
        procs_per_host=1,
        link="1gbit",
        devices=1,
        timeout=110,
        env=worker_env(host_tier=False),
    )
    assert r.returncode == 0, r.output[-4000:]
    prof = Profile.from_json(json.loads(out.read_text()), str(out))
    topo = prof.topology
    assert (topo["processes"], topo["hosts"], topo["per_host"]) == (2, 2, 1)
    assert topo["cluster"]["link"] == "1gbit" and topo["cluster"]["rate_bps"] == RATE
    assert prof.has("network") and not prof.has("host")  # one process per host
    assert "one per host" in topo["measured"]["network"]
    # physics: the ring allreduce of n bytes between two hosts sends n bytes each
    # way over a link of RATE bit/s, of which a bucket of BURST bytes may pass at once
    raw = [s for s in prof.fit["raw"]["network"] if s[0] == "allreduce" and len(s) == 4]
    n, _, seconds = max((s[1], s[2], s[3]) for s in raw)
    assert seconds >= (n - BURST) * 8 / RATE, (n, seconds)
    # The fitted bandwidth is the network's, not shared memory's (28 Gb/s here, a
    # 21 MB allreduce in 6 ms). It is not bounded by the rate: quick's 16 KiB
    # samples fit in tbf's bucket (BURST) and cross at veth speed, 3-8x faster per
    # byte than the 1 MiB ones, and one alpha + beta line fitted to both by relative
    # least squares lands between them (2.5-3.0x the rate in three runs here; the 3x
    # bound this test had failed a CI run at 3.07x). 8x keeps it well below shared
    # memory's; the 1 MiB samples themselves are bounded by physics above.
    assert 8 / prof.link("network").beta <= 8 * RATE
    assert "emulated cluster: links shaped to 1gbit" in r.output
