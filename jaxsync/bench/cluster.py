"""``python -m jaxsync bench --suite cluster``: the benchmark on a network.

What it is for: running the MPI benchmark (every strategy, ``comm_dtype=bfloat16``,
the peers: per-leaf mpi4jax, ``jax.distributed`` with a global mesh and ``pmean``,
the bare MPI allreduce) and the compression suite (``powersgd_mean``,
``sign_mean``) inside the emulated cluster (``jaxsync.cluster``), for each
configuration of hosts x processes per host x devices per process and link rate,
and putting every row beside **the link's limit**: the bytes each host must send
over its link in any allreduce between ``H`` hosts (``2 (H-1)/H`` of the tree;
the whole tree for 2 hosts), over the link rate measured in the same run (MPI
messages one way at a time between host 0 and the last host, before each
configuration's benchmark). Beside every figure ``cpu_busy``: the machine's busy CPU share
while it was timed (``timing.CpuMeter``, ``/proc/stat``), per case for the MPI
bench's rows, over the whole run for the compression suite's. Writes
``cluster.json`` (rows, rates, commands), ``cluster.md`` (the table),
``cluster.png`` (each method's time over the link's limit) and, after the first
configuration's timed runs, ``cluster-timeline.png`` (``trace``).
What it may import: numpy, matplotlib, ``jaxsync.cluster``, the standard library,
``timing.CpuMeter``, ``report.draw_timeline``; what runs inside the cluster is
``cluster_inside`` (the rate probe, the timeline's synchronisations).

Example:
  >>> from jaxsync.bench import cluster
  >>> cluster.limit_ms(21e6, hosts=2, rate_bps=1e9)  # the whole tree over 1 Gb/s
  168.0
  >>> [c.name for c in cluster.configs([2], [1, 2], [1], ["1gbit"])]
  ['2x1x1@1gbit', '2x2x1@1gbit']
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from .cluster_inside import TRACE_STEPS, probe, trace

CPU_NOTE = (
    "CPU busy: the share of the machine's CPU time busy while the row's case was timed "
    "(/proc/stat, every process and the kernel's network work; 'run': over the compression "
    "suite's whole run). Low: the wire set the time; near 100%: the CPUs did, or MPI polled "
    "while it waited (a row near 1.0x the link's limit is wire-bound whatever its share)."
)


def limit_ms(tree_bytes: float, hosts: int, rate_bps: float) -> float:
    """The link's limit: the bytes one host must send in an allreduce over ``hosts``."""
    return 2 * (hosts - 1) / hosts * tree_bytes * 8 / rate_bps * 1e3


@dataclasses.dataclass(frozen=True)
class Config:
    hosts: int
    procs: int
    devices: int
    link: str

    @property
    def name(self) -> str:
        return f"{self.hosts}x{self.procs}x{self.devices}@{self.link}"


def configs(hosts, procs, devices, links) -> list[Config]:
    return [Config(h, p, d, link) for link in links for h in hosts for p in procs for d in devices]


def _run(cfg: Config, cmd: list[str], timeout: float, log) -> tuple[int, str, float]:
    """Run ``cmd`` in the cluster: its exit status, output and the share of the
    machine's CPU time busy while it ran (the hosts share this machine)."""
    from jaxsync import cluster

    from .timing import CpuMeter

    log(f"[cluster bench] {cfg.name}: {' '.join(cmd[1:])}")
    with CpuMeter() as meter:
        r = cluster.run(
            cmd,
            hosts=cfg.hosts,
            procs_per_host=cfg.procs,
            link=cfg.link,
            devices=cfg.devices,
            timeout=timeout,
        )
    if r.returncode != 0:
        log(r.output[-4000:])
    return r.returncode, r.output, round(meter.machine, 3)


def measure(cfg: Config, out: Path, args, log, trace_dir: Path | None = None) -> dict:
    """One configuration: the rate probe, the MPI bench, the compression suite and,
    with ``trace_dir``, the traced run (after the timed ones)."""
    py = sys.executable
    d = out / cfg.name
    d.mkdir(parents=True, exist_ok=True)
    rc, text, _ = _run(cfg, [py, "-m", "jaxsync.bench.cluster", "probe"], 120, log)
    rate = None
    for line in text.splitlines():
        if '"rate_bps"' in line:
            rate = json.loads(line.split("] ", 1)[1])["rate_bps"]
    bench = [py, "-m", "jaxsync", "bench", "--no-sweeps", "--devices", str(cfg.devices)]
    bench += ["--repeats", str(args.repeats), "--out", str(d)]
    bench += ["--quick"] if args.quick else ["--trees", *args.trees]
    rc_b, _, cpu_b = _run(cfg, bench, args.timeout, log)
    comp = [py, "-m", "jaxsync", "bench", "--suite", "compress", "--out", str(d)]
    comp += ["--quick"] if args.quick else ["--rounds", str(args.repeats)]
    skip = (0, "", float("nan"))
    rc_c, _, cpu_c = skip if args.no_compress else _run(cfg, comp, args.timeout, log)
    rc_t = 0
    if trace_dir is not None:
        tree = "mixed_tiny" if args.quick else args.trees[0]
        cmd = [py, "-m", "jaxsync.bench.cluster", "trace", str(trace_dir), tree]
        rc_t = _run(cfg, cmd, args.timeout, log)[0]
    rows = []
    if rc_b == 0:
        for r in json.loads((d / "mpi.json").read_text())["rows"]:
            if r["kind"] != "sweep":
                rows.append(
                    dict(
                        tree=r["tree"],
                        method=r["method"],
                        kind=r["kind"],
                        tree_bytes=r["tree_bytes"],
                        ms=r["median_ms"],
                        q25_ms=r["q25_ms"],
                        q75_ms=r["q75_ms"],
                        cpu_busy=r.get("cpu_busy", float("nan")),
                        cpu_ranks=r.get("cpu_ranks", float("nan")),
                        cpu_scope="case",
                    )
                )
    if rc_c == 0 and not args.no_compress:
        comp_rows = json.loads((d / "compress-mpi.json").read_text())["rows"]
        # hierarchical_mean's payload is the tree's bytes
        full = {r["tree"]: r["payload_bytes"] for r in comp_rows if r["sync"] == "hierarchical"}
        for r in comp_rows:
            rows.append(
                dict(
                    tree=r["tree"],
                    method=f"{r['sync']} (compress suite)",
                    kind="compress",
                    tree_bytes=full.get(r["tree"]),
                    ms=r["marginal_ms"],
                    step_ms=r["base_step_ms"] + r["marginal_ms"],
                    cpu_busy=cpu_c,
                    cpu_scope="run",
                )
            )
    return dict(
        config=dataclasses.asdict(cfg),
        name=cfg.name,
        rate_bps=rate,
        cpu_busy_runs=dict(bench=cpu_b, compress=cpu_c),
        returncodes=dict(probe=rc, bench=rc_b, compress=rc_c, trace=rc_t),
        rows=rows,
    )


def summarise(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """Rows with the link's limit and each time over it; the issue's targets."""
    table, targets = [], []
    for res in results:
        cfg, rate = res["config"], res["rate_bps"]
        sizes = {r["tree"]: r["tree_bytes"] for r in res["rows"] if r.get("tree_bytes")}
        for r in res["rows"]:
            nbytes = r.get("tree_bytes") or sizes.get(r["tree"])
            lim = limit_ms(nbytes, cfg["hosts"], rate) if rate and nbytes else float("nan")
            row = dict(config=res["name"], **r)
            row.update(tree_bytes=nbytes, limit_ms=lim, x_limit=r["ms"] / lim)
            table.append(row)
        by = {(r["tree"], r["method"]): r for r in res["rows"]}
        for tree in sorted({r["tree"] for r in res["rows"]}):
            jd = by.get((tree, "jax.distributed pmean"))
            for m in ("naive", "flat", "hierarchical", "two_dimensional"):
                if jd and (tree, m) in by:
                    ratio = by[(tree, m)]["ms"] / jd["ms"]
                    name = f"{m} <= jax.distributed pmean"
                    targets.append(_target(res["name"], tree, name, ratio, ratio <= 1.0))
            h = by.get((tree, "hierarchical (compress suite)"))
            p = by.get((tree, "powersgd r4 (compress suite)"))
            if h and p and cfg["procs"] == 1 and cfg["link"] == "1gbit":
                ratio = h["step_ms"] / p["step_ms"]
                name = "train step: hierarchical / powersgd r4 >= 3"
                targets.append(_target(res["name"], tree, name, ratio, ratio >= 3.0))
    return table, targets


def _target(config, tree, name, value, passed) -> dict:
    return dict(config=config, tree=tree, name=name, value=value, passed=passed)


def write(out: Path, results, table, targets, meta) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "cluster.json", out / "cluster.md"]
    paths[0].write_text(
        json.dumps(dict(meta=meta, results=results, table=table, targets=targets), indent=1)
    )
    lines = [
        "| configuration | tree | method | ms | x link limit | CPU busy |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['config']} | {r['tree']} | {r['method']} | {r['ms']:.1f} | "
            f"{r['x_limit']:.2f} | {_share(r)} |"
        )
    lines += ["", "| configuration | tree | target | value | |", "|---|---|---|---|---|"]
    for t in targets:
        lines.append(
            f"| {t['config']} | {t['tree']} | {t['name']} | {t['value']:.2f} | "
            f"{'PASS' if t['passed'] else 'MISS'} |"
        )
    rates = ", ".join(
        f"{r['name']}: {r['rate_bps'] / 1e9:.3f} Gb/s" for r in results if r["rate_bps"]
    )
    lines += ["", f"Measured link rates (MPI, one way at a time): {rates}."]
    lines.append(CPU_NOTE)
    paths[1].write_text("\n".join(lines) + "\n")
    if table:
        paths.append(_plot(out / "cluster.png", table))
    return paths


def _share(row: dict) -> str:
    v = row.get("cpu_busy", float("nan"))
    return "-" if v != v else f"{v:.0%}" + (" (run)" if row.get("cpu_scope") == "run" else "")


def _plot(path: Path, table) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keep = [
        r
        for r in table
        if r["kind"] in ("jaxsync", "peer", "bare", "compress") and r["x_limit"] == r["x_limit"]
    ]
    cfgs = sorted({r["config"] for r in keep})
    trees = sorted({r["tree"] for r in keep})
    fig, axes = plt.subplots(len(trees), 1, figsize=(11, 3.2 * len(trees)), squeeze=False)
    for ax, tree in zip(axes[:, 0], trees):
        methods = sorted({r["method"] for r in keep if r["tree"] == tree})
        width = 0.8 / max(1, len(cfgs))
        for i, c in enumerate(cfgs):
            vals = {
                r["method"]: r["x_limit"] for r in keep if r["tree"] == tree and r["config"] == c
            }
            ax.bar(
                [j + i * width for j in range(len(methods))],
                [vals.get(m, 0) for m in methods],
                width,
                label=c,
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(
            [j + 0.4 for j in range(len(methods))], methods, rotation=40, ha="right", fontsize=7
        )
        ax.set_ylabel("x link's limit")
        ax.set_yscale("log")
        ax.set_title(tree, fontsize=9)
        ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench --suite cluster",
        description="The benchmark on a network: the MPI and compression suites inside "
        "the emulated cluster (python -m jaxsync cluster) for each configuration, beside "
        "the link's limit (the bytes each host must send over the measured link rate).",
    )
    p.add_argument("--hosts", type=int, nargs="+", default=[2])
    p.add_argument(
        "--procs", type=int, nargs="+", default=[1, 2, 4], help="processes per host (default 1 2 4)"
    )
    p.add_argument(
        "--devices",
        type=int,
        nargs="+",
        default=[1, 2],
        help="fake CPU devices per process (default 1 2)",
    )
    p.add_argument("--links", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--trees", nargs="+", default=["resnet18", "small500", "transformer", "mixed"])
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one configuration (2x1x1 at 1gbit), tiny trees: a smoke test",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="time limit of each run inside the cluster, seconds (default 1800)",
    )
    no_comp = "leave out the compression suite (its powersgd and sign rows)"
    p.add_argument("--no-compress", action="store_true", help=no_comp)
    p.add_argument("--out", type=Path, default=Path("bench-results/cluster"))
    no_tl = "skip cluster-timeline.png (the first configuration's, after its timed runs)"
    p.add_argument("--no-timeline", action="store_true", help=no_tl)
    args = p.parse_args(argv)
    if args.quick:
        args.hosts, args.procs, args.devices, args.links = [2], [1], [1], ["1gbit"]
        args.repeats = 1
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["probe"]:
        return probe()
    if argv[:1] == ["trace"]:
        return trace(argv[1], argv[2])
    args = _parse(argv)
    from jaxsync import cluster

    try:
        cluster.check()
    except cluster.ClusterUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.time()
    trace_dir = None if args.no_timeline else args.out / "timeline"
    results = [
        measure(c, args.out, args, log, trace_dir if i == 0 else None)
        for i, c in enumerate(configs(args.hosts, args.procs, args.devices, args.links))
    ]
    table, targets = summarise(results)
    meta = dict(
        argv=argv,
        seconds=round(time.time() - t0),
        cpus=os.cpu_count(),
        loadavg_end=os.getloadavg(),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        cpu_busy="share of the machine's CPU time busy while each row was timed (/proc/stat)",
    )
    if trace_dir is not None and results:
        from .report import draw_timeline

        got = draw_timeline(trace_dir, args.out / "cluster-timeline.png")
        meta["timeline"] = dict(config=results[0]["name"], steps=TRACE_STEPS, **(got or {}))
    for path in write(args.out, results, table, targets, meta):
        print(f"wrote {path}")
    print((args.out / "cluster.md").read_text())
    failed = [r["name"] for r in results if any(r["returncodes"].values())]
    if failed:
        print(f"runs that failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
