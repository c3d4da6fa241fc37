"""The projection held to published figures (``published.json``, frozen).

What it is for: :func:`fit_defaults` recomputes the model's fitted defaults
from the rows marked ``fit`` (NCCL's NVLink and NIC efficiencies, EFA's, the
per-hop and per-host latencies, each Horovod model's unpublished compute time);
:func:`evaluate` compares the projection with every ``held_out`` row
(collectives as times, training rows as efficiencies) and says, per row, the
ratio and whether it is within 25 %. ``python -m jaxsync tune --accuracy``
prints the table; docs/planning.md shows it; a test holds 3 in 4 rows.

May import: the standard library and ``_project_model``.

Example:
  >>> rows = evaluate()
  >>> sum(r["ok"] for r in rows) >= 0.75 * len(rows)
  True
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ._project_model import Cluster, NcclLatency, exposed, nccl_allreduce

TABLE = Path(__file__).with_name("published.json")
LIMIT = 0.25
BACKWARD_SHARE = 2 / 3
"""Stated, not published: the backward pass is about twice the forward."""
FUSION_BYTES = 64 * 2**20
"""Horovod's default tensor-fusion buffer: the buckets of an overlapped sync."""


def rows() -> list[dict]:
    data = json.loads(TABLE.read_text())
    assert data["format"] == "jaxsync-published-1"
    return data["rows"]


def _row(rid: str) -> dict:
    return next(r for r in rows() if r["id"] == rid)


def fit_defaults() -> dict:
    """The defaults the fit rows give (rounded as the code's defaults are)."""
    launch = NcclLatency().launch
    hop = (_row("nccl-a100-2x1-hdr-8B")["figure"]["time_us"] * 1e-6 - launch) / 2
    h20 = _row("nccl-h20-2x8-ndr-4B")["figure"]["time_us"] * 1e-6
    intra = h20 - launch - 2 * hop
    h100 = _row("nccl-h100-ring-busbw")
    intra_eff = h100["figure"]["busbw_gbs"] / h100["setup"]["intra_gbs"]
    ib = _row("nccl-ib-nic-efficiency")
    net_eff = ib["figure"]["per_nic_gbs"] / (ib["setup"]["nic_gbps"] / 8)
    p4 = _row("nccl-p4dn-4nodes-1GiB")
    s = p4["setup"]
    n = s["hosts"] * s["devices"]
    busbw = 2 * (n - 1) / n * p4["figure"]["bytes"] / (p4["figure"]["time_us"] * 1e-6)
    efa_eff = busbw / (s["rails"] * s["net_gbps"] / 8 * 1e9)
    return {
        "hop": hop,
        "intra": intra,
        "intra_eff": intra_eff,
        "net_eff": net_eff,
        "efa_eff": efa_eff,
    }


def _cluster(setup: dict, fit: dict) -> Cluster:
    kw = {k: v for k, v in setup.items() if k in ("hosts", "devices", "intra_gbs", "rails")}
    if "net_gbps" in setup:
        kw["net_gbps"] = float(setup["net_gbps"])
    if "intra_gbs" in kw:
        kw["intra_gbs"] = float(kw["intra_gbs"])
    eff = fit["efa_eff"] if setup.get("net_eff") == "efa" else fit["net_eff"]
    return Cluster(**kw, net_eff=eff, intra_eff=fit["intra_eff"])


def _latency(fit: dict) -> NcclLatency:
    return NcclLatency(intra=fit["intra"], hop=fit["hop"])


def _training_sync(row: dict, fit: dict) -> tuple[float, int]:
    nbytes = 4 * row["params"]
    t, _ = nccl_allreduce(nbytes, _cluster(row["setup"], fit), _latency(fit))
    return t, max(1, math.ceil(nbytes / FUSION_BYTES))


def _efficiency(compute: float, sync: float, buckets: int) -> float:
    return exposed(sync, compute, BACKWARD_SHARE, buckets)["overlap"]["efficiency"]


def fitted_compute(model: str, fit: dict | None = None) -> float:
    """The compute time per step at which the overlapped sync gives the fit
    row's efficiency (bisection; efficiency rises with compute)."""
    fit = fit or fit_defaults()
    row = next(r for r in rows() if r.get("model") == model and r["split"] == "fit")
    sync, k = _training_sync(row, fit)
    want, lo, hi = row["figure"]["efficiency"], 1e-6, 1e3
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _efficiency(mid, sync, k) < want else (lo, mid)
    return hi


def predict_row(row: dict, fit: dict | None = None) -> tuple[float, float, str]:
    """``(predicted, published, unit)`` of one row."""
    fit = fit or fit_defaults()
    f = row["figure"]
    if row["kind"] == "nic":  # a rate: what one NIC carries in a collective
        return row["setup"]["nic_gbps"] / 8 * fit["net_eff"], f["per_nic_gbs"], "GB/s a NIC"
    if row["kind"] == "collective":
        c = _cluster(row["setup"], fit)
        t, algo = nccl_allreduce(f["bytes"], c, _latency(fit))
        if "time_us" in f:
            want = f["time_us"]
        else:  # nccl-tests' bus bandwidth: 2 (N-1)/N of the bytes in the time
            n = c.hosts * c.devices
            want = 2 * (n - 1) / n * f["bytes"] / (f["busbw_gbs"] * 1e9) * 1e6
        return t * 1e6, want, f"us ({algo})"
    sync, k = _training_sync(row, fit)
    eff = _efficiency(fitted_compute(row["model"], fit), sync, k)
    return eff, row["figure"]["efficiency"], "efficiency"


def evaluate(split: str = "held_out") -> list[dict]:
    """Every row of ``split``: predicted, published, ratio, within 25 %."""
    fit = fit_defaults()
    out = []
    for r in rows():
        comparable = {"bytes", "efficiency"} & set(r["figure"]) or r["kind"] == "nic"
        if r["split"] != split or not comparable:
            continue  # (fit rows of a rate or a ratio: used by fit_defaults only)
        got, want, unit = predict_row(r, fit)
        ratio = got / want
        out.append(
            {
                "id": r["id"],
                "path": r["path"],
                "predicted": got,
                "published": want,
                "unit": unit,
                "ratio": ratio,
                "ok": abs(ratio - 1) <= LIMIT,
                "source": r["source"]["url"],
                "uncertainty": r["uncertainty"],
            }
        )
    return out


def accuracy_table(split: str = "held_out") -> str:
    """Markdown: the rows of ``split`` against the projection."""
    lines = [
        "| row | path | published | projected | ratio | within 25 % |",
        "|---|---|---|---|---|---|",
    ]
    for r in evaluate(split):
        unit = r["unit"]
        fmt = (lambda x: f"{x:.2f}") if unit == "efficiency" else (lambda x: f"{x:,.1f}")
        lines.append(
            f"| [{r['id']}]({r['source']}) | {r['path']} | {fmt(r['published'])} | "
            f"{fmt(r['predicted'])} {unit} | {r['ratio']:.2f} | {'yes' if r['ok'] else 'no'} |"
        )
    return "\n".join(lines)


CLUSTER_RUNS = ("cluster-100mbit.json", "cluster-1gbit.json")
CPU_BOUND_BUSY = 0.33
"""A row timed while the machine was more than this share busy is CPU-bound (the
README's benchmark section: wire-bound rows 10-32% busy, CPU-bound 35-87%)."""


def in_sample(folder) -> list[dict]:
    """This machine's emulated-cluster runs (``docs/bench/cluster``) against the cost
    model on the native CPU path, the network link at the rate measured in the
    same run (latency 30 us, stated), the host link the built-in default's: per
    configuration, tree (the 22 and 19 MB ones) and lossless strategy, measured /
    projected and whether the row was CPU-bound. In-sample: the defaults were
    made on this machine."""
    from jaxsync._core._plan import make_plan
    from jaxsync.bench import trees as _trees

    from ._choose import buckets_of
    from ._cost import DEFAULT_PROFILE, Link
    from ._cost_ops import ModelTopology, per_leaf_plan, predict, strategy_defaults

    trees = _trees.make_trees(False)
    out = []
    for name in CLUSTER_RUNS:
        data = json.loads((Path(folder) / name).read_text())
        for res in data["results"]:
            cfg = res["config"]
            topo = ModelTopology(processes=2 * cfg["procs"], hosts=cfg["hosts"])
            net = Link(
                alpha=30e-6, beta=8 / res["rate_bps"], gamma=DEFAULT_PROFILE.link("network").gamma
            )
            prof = DEFAULT_PROFILE.replace_link("network", net)
            for row in res["rows"]:
                s = row["method"]
                if row["kind"] != "jaxsync" or s not in ("hierarchical", "two_dimensional", "flat"):
                    continue
                if row["tree"] not in ("resnet18", "transformer"):
                    continue
                b, t = strategy_defaults(s)
                plan = make_plan(
                    trees[row["tree"]](),
                    bucket_bytes=b,
                    pack_threshold=t,
                    per_leaf=per_leaf_plan(s, topo),
                )
                got = predict(s, buckets_of(plan), topo, prof, bucket_bytes=b) * 1e3
                out.append(
                    {
                        "config": res["name"],
                        "tree": row["tree"],
                        "strategy": s,
                        "measured_ms": row["ms"],
                        "projected_ms": got,
                        "ratio": row["ms"] / got,
                        "cpu_busy": row["cpu_busy"],
                        "cpu_bound": row["cpu_busy"] > CPU_BOUND_BUSY,
                    }
                )
    return out


def in_sample_table(folder) -> str:
    lines = [
        "| run | tree | strategy | measured | projected | measured / projected | CPU busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in in_sample(folder):
        busy = f"{r['cpu_busy']:.0%}" + (" (CPU-bound)" if r["cpu_bound"] else "")
        lines.append(
            f"| {r['config']} | {r['tree']} | {r['strategy']} | {r['measured_ms']:.1f} ms | "
            f"{r['projected_ms']:.1f} ms | {r['ratio']:.2f} | {busy} |"
        )
    return "\n".join(lines)
