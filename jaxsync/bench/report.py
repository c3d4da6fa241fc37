"""The bench's output: targets (PASS/MISS), the table, ``<mode>.json``/``.csv``/``.png``.

What it is for: turning the ``Row``s of a run into the issues' targets, a rich
table on the terminal, the JSON and CSV files under ``--out`` (columns: the fields
of ``timing.Row``; ``docs/bench/*.json`` are such files) and the bar plot (a
suite's own figure saved by ``save_plot``); and the timeline picture the cluster
and overlap suites store (``draw_timeline``).
What it may import: matplotlib, rich, the standard library,
``jaxsync.bench.timing`` / ``methods`` / ``trees`` (for ``Row`` and constants)
and the timeline's merge and draw (``jaxsync._cli._timeline``).

Example:
  >>> from jaxsync.bench import report
  >>> report.evaluate_targets([])
  []
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

from .methods import DEFAULT_METHOD, STRATEGY_METHODS
from .timing import Row
from .trees import KiB, MiB

# Targets of the issues (evaluated and printed here, never asserted in tests).
LIMIT_MPI_VS_BARE = 1.0  # default (README's step, 1 device/process) vs out-of-place bare
LIMIT_MPI_VS_INPLACE = 1.4  # ... vs the in-place bare allreduce
LIMIT_MPI_SMALL = 4.0  # ... on 500 small leaves, vs bare
LIMIT_FLAT_2D = 1.25  # flat (ResNet-like) and two_dimensional vs bare
LIMIT_MULTI_DEVICE = 1.5  # several devices: vs bare allreduce + bare psum (or psum alone)
LIMIT_BF16_SPEEDUP = 1.7  # comm_dtype=bf16 at least this much faster than f32
LARGE_PARAMS = 10**6


@dataclasses.dataclass
class Target:
    name: str
    tree: str
    ratio: float
    limit: str
    passed: bool | None  # None: not applicable / not measurable
    note: str = ""


def _overlap(a: Row, b: Row) -> bool:
    return a.q25_ms <= b.q75_ms and b.q25_ms <= a.q75_ms


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def evaluate_targets(rows: list[Row], devices: int = 1) -> list[Target]:
    """The issues' targets, per tree, measured side by side in one run.

    * the default no slower than the best peer, and every strategy no slower than
      the per-leaf mpi4jax loop (median marginal costs);
    * under MPI with one device per process (the README's shard_map step): the
      default <= 1.0x the out-of-place bare allreduce and <= 1.4x the in-place one
      on trees of >= 1M parameters, <= 4x on 500 small leaves; ``flat`` <= 1.25x on
      the ResNet-like tree and ``two_dimensional`` <= 1.25x on trees of >= 1M;
    * with several devices per process: the default <= 1.5x (bare allreduce + bare
      psum) under MPI, <= 1.5x the bare psum in one process (trees of >= 1M);
    * under MPI with the ``jax.distributed`` peer: every strategy <= 1.0x it;
    * ``comm_dtype=bfloat16`` >= 1.7x faster than float32 where it sends fewer
      bytes (float32 trees of >= 1M parameters).

    A ratio that noise makes meaningless (a median <= 0) gives ``passed=None``.
    """
    out = []
    by_tree: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_tree.setdefault(r.tree, {})[r.method] = r

    def target(name, tree, ratio, limit, note=""):
        out.append(
            Target(name, tree, ratio, f"<= {limit:.2f}", _check(ratio, lambda x: x <= limit), note)
        )

    for tree, rs in by_tree.items():
        d = rs[DEFAULT_METHOD]
        mode = d.mode
        large = d.params >= LARGE_PARAMS
        small = d.leaves >= 500 and d.tree_bytes / d.leaves <= 4 * KiB
        peers = [r for r in rs.values() if r.kind == "peer"]
        if peers:
            best = min(peers, key=lambda r: r.median_ms)
            note = f"best peer {best.method}"
            if _overlap(d, best):
                note += "; IQRs overlap (within noise)"
            target(
                "default no slower than best peer",
                tree,
                _ratio(d.median_ms, best.median_ms),
                1.0,
                note,
            )
        # Every strategy against each peer a user would write instead of jaxsync
        # (against the mpi4jax loop, the plain-jit rows too).
        for peer, label, forms in (
            ("mpi4jax/leaf", "the mpi4jax loop", ("", " (jit)")),
            ("jax.distributed pmean", "jax.distributed pmean", ("",)),
        ):
            if peer not in rs:
                continue
            for m in STRATEGY_METHODS:
                for name in (m + f for f in forms):
                    if name in rs:
                        target(
                            f"{name} no slower than {label}",
                            tree,
                            _ratio(rs[name].median_ms, rs[peer].median_ms),
                            1.0,
                        )
        bare = d.median_ms / d.ratio_to_bare if d.ratio_to_bare else float("nan")
        if mode == "mpi" and devices == 1:
            inplace = rs.get("mpi4py bare in-place")
            if large:
                target("default vs bare allreduce", tree, d.ratio_to_bare, LIMIT_MPI_VS_BARE)
                if inplace is not None:
                    target(
                        "default vs in-place bare allreduce",
                        tree,
                        _ratio(d.median_ms, inplace.median_ms),
                        LIMIT_MPI_VS_INPLACE,
                    )
                if "two_dimensional" in rs:
                    target(
                        "two_dimensional vs bare",
                        tree,
                        rs["two_dimensional"].ratio_to_bare,
                        LIMIT_FLAT_2D,
                    )
                if tree.startswith("resnet") and "flat" in rs:
                    target("flat vs bare", tree, rs["flat"].ratio_to_bare, LIMIT_FLAT_2D)
            if small:
                target(
                    f"default vs bare, {d.leaves} small leaves",
                    tree,
                    d.ratio_to_bare,
                    LIMIT_MPI_SMALL,
                )
        elif mode == "mpi" and large and "psum bare" in rs:
            both = bare + rs["psum bare"].median_ms
            target(
                "default vs bare allreduce + bare psum",
                tree,
                _ratio(d.median_ms, both),
                LIMIT_MULTI_DEVICE,
            )
        elif mode == "intra" and large:
            target("default vs bare psum", tree, d.ratio_to_bare, LIMIT_MULTI_DEVICE)
        low = rs.get(f"{DEFAULT_METHOD} bf16")
        all_f32 = d.tree_bytes == 4 * d.params
        if low is not None and large and all_f32:
            speed = _ratio(d.median_ms, low.median_ms)
            note = f"wire {d.wire_bytes / MiB:.1f} -> {low.wire_bytes / MiB:.1f} MiB"
            narrower = low.wire_bytes < d.wire_bytes
            if not narrower:
                note += "; not narrower on the wire here, so not applicable"
            out.append(
                Target(
                    f"bf16 comm >= {LIMIT_BF16_SPEEDUP}x faster than f32",
                    tree,
                    speed,
                    f">= {LIMIT_BF16_SPEEDUP:.2f}",
                    _check(speed, lambda x: x >= LIMIT_BF16_SPEEDUP) if narrower else None,
                    note,
                )
            )
    return out


def _check(x, ok):
    return bool(ok(x)) if math.isfinite(x) else None


# Output: table, files, plot


def print_report(rows: list[Row], targets: list[Target], meta: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=132)
    table = Table(
        title=f"jaxsync bench, {meta['mode']}: {meta['devices']} device(s) x "
        f"{meta['processes']} process(es); marginal cost of the sync "
        f"inside a jitted step, median over {meta['repeats']} rounds"
    )
    for col in (
        "tree",
        "method",
        "ms",
        "IQR ms",
        "x bare",
        "wire MiB",
        "arrays",
        "ops",
        "faults",
        "compile s",
        "CPU",
    ):
        table.add_column(col, justify="left" if col in ("tree", "method") else "right")
    last = None
    for r in rows:
        if last is not None and r.tree != last:
            table.add_section()
        style = {"bare": "dim", "limit": "dim", "peer": "cyan", "sweep": "magenta"}.get(r.kind, "")
        if r.method == DEFAULT_METHOD:
            style = "bold"
        table.add_row(
            r.tree if r.tree != last else "",
            r.method,
            f"{r.median_ms:.3f}",
            f"{r.q25_ms:.2f}..{r.q75_ms:.2f}",
            f"{r.ratio_to_bare:.2f}",
            f"{r.wire_bytes / MiB:.2f}",
            str(r.arrays),
            str(r.ops),
            f"{r.faults_per_call:.0f}",
            f"{r.compile_s:.2f}",
            "-" if r.cpu_busy != r.cpu_busy else f"{r.cpu_busy:.0%}",
            style=style,
        )
        last = r.tree
    console.print(table)
    console.print(
        "[dim]ms: marginal cost (step with sync - step without); x bare: ratio of "
        "medians to the bare collective of the same bytes; wire: modelled bytes "
        "sent per replica; arrays: arrays handed to collectives; ops: collective "
        "instructions after XLA; faults: extra minor page faults per call; CPU: "
        "share of the machine's CPU time busy while the case ran (/proc/stat: low, "
        "the wire set the time; near 100%, the CPUs did, or MPI polled). "
        f"{'Host allocator tuned. ' if meta['tune_host_allocator'] else ''}"
        f"{meta['seconds']} s, load average {meta['loadavg_start'][0]:.1f} -> "
        f"{meta['loadavg_end'][0]:.1f}.[/dim]"
    )
    for t in targets:
        tag = {
            True: "[green]PASS[/green]",
            False: "[red]MISS[/red]",
            None: "[yellow]N/A [/yellow]",
        }[t.passed]
        console.print(
            f"{tag} {escape(t.name)} ({t.tree}): {t.ratio:.2f} (target "
            f"{t.limit})" + (f"  {escape(t.note)}" if t.note else "")
        )


def write_files(rows: list[Row], targets: list[Target], meta: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / meta["mode"]
    paths = [stem.with_suffix(".json"), stem.with_suffix(".csv"), stem.with_suffix(".png")]
    paths[0].write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": [dataclasses.asdict(r) for r in rows],
                "targets": [dataclasses.asdict(t) for t in targets],
            },
            indent=1,
        )
    )
    fields = [f.name for f in dataclasses.fields(Row) if f.name != "samples_ms"]
    with open(paths[1], "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))
    plot(rows, meta, paths[2])
    return paths


def save_plot(draw: Callable[[Path], None], path: Path) -> None:
    """``draw(path)`` (a suite's figure) and say where it went; without
    matplotlib (``draw`` raises ``ImportError``) say that there is no plot."""
    try:
        draw(path)
        print(f"wrote {path}")
    except ImportError:
        print("matplotlib not installed: no plot")


def plot(rows: list[Row], meta: dict, path: Path) -> None:
    """Grouped bars of the marginal cost, methods per tree (log scale); the flat
    sweep in a second panel, next to flat, hierarchical and the bare collective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = {r.tree for r in rows if r.kind == "sweep"}
    panels = [[r for r in rows if r.kind != "sweep"]]
    if swept:
        panels.append(
            [
                r
                for r in rows
                if r.tree in swept
                and (r.kind in ("sweep", "bare") or r.method in ("flat", DEFAULT_METHOD))
            ]
        )
    fig, axes = plt.subplots(len(panels), 1, figsize=(15, 5 * len(panels)), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, prow in zip(axes[:, 0], panels):
        trees = list(dict.fromkeys(r.tree for r in prow))
        methods = list(dict.fromkeys(r.method for r in prow))
        positive = [r.median_ms for r in prow if r.median_ms > 0] or [1.0]
        floor = min(positive) / 4  # medians <= 0 (below noise) are drawn at the floor
        by_tree = {t: {r.method: r for r in prow if r.tree == t} for t in trees}
        width = 0.85 / max(len(b) for b in by_tree.values())
        for j, m in enumerate(methods):
            xs, ys, lo, hi = [], [], [], []
            for i, t in enumerate(trees):
                r = by_tree[t].get(m)
                if r is None:
                    continue
                k, n = list(by_tree[t]).index(m), len(by_tree[t])  # centred per tree
                y = max(r.median_ms, floor)
                xs.append(i + (k - (n - 1) / 2) * width)
                ys.append(y)
                lo.append(y - min(max(r.q25_ms, floor), y))
                hi.append(max(r.q75_ms - y, 0))
            ax.bar(
                xs,
                ys,
                width,
                yerr=[lo, hi],
                label=m,
                color=cmap(j % 20),
                capsize=2,
                edgecolor="black" if m == DEFAULT_METHOD else "none",
            )
        ax.set_xticks(range(len(trees)), trees)
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor)
        ax.set_ylabel("marginal ms per step (log)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_title(
        f"jaxsync bench ({meta['mode']}: {meta['devices']} device(s) x "
        f"{meta['processes']} process(es)); bars: median, whiskers: IQR; "
        "black edge: the default"
    )
    if swept:
        axes[1, 0].set_title("flat swept over bucket_bytes (b) and pack_threshold (t)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_timeline(directory: Path, png: Path) -> dict | None:
    """Merge the ranks' timeline files in ``directory`` into ``timeline.json`` there
    and draw ``png`` with ``python -m jaxsync timeline``'s code. What was written,
    for the JSON (``{"trace", "png", "summary"}``; ``png`` None without
    matplotlib), or None: no ``rank*.json`` there."""
    from jaxsync._cli import _timeline

    if not list(directory.glob("rank*.json")):
        return None
    docs = _timeline.load(directory)
    doc = _timeline.merge(docs)
    (directory / "timeline.json").write_text(json.dumps(doc))
    out: dict = {"trace": str(directory / "timeline.json"), "png": None}
    try:
        _timeline.draw(doc, png)
        out["png"] = str(png)
    except ImportError:
        pass
    out["summary"] = _timeline.summary(docs)
    return out
