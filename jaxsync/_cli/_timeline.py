"""``python -m jaxsync timeline DIR``: the ranks' timelines as one trace and a picture.

Reads the ``DIR/rank*.json`` files that :func:`jaxsync.timeline` (or
``JAXSYNC_TIMELINE=DIR``) wrote, writes ``DIR/timeline.json`` (one Chrome trace
of every rank: a process per rank, its threads as lanes) and draws
``DIR/timeline.png`` with matplotlib: a lane per rank and thread (the steps,
XLA's threads that made calls, each communicator's communication lane), a bar
per call coloured by its kind. It also prints, per rank, the calls and the
share of the steps' time spent inside them.

Imports: the standard library and matplotlib (public API only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(directory: Path) -> list[dict]:
    """The ranks' trace documents, in rank order."""
    paths = sorted(directory.glob("rank*.json"), key=lambda p: int(p.stem[4:] or 0))
    if not paths:
        raise SystemExit(
            f"python -m jaxsync timeline: no rank*.json in {directory}. Record one with "
            "`with jaxsync.timeline(DIR):` or JAXSYNC_TIMELINE=DIR first."
        )
    return [json.loads(p.read_text()) for p in paths]


def merge(docs: list[dict]) -> dict:
    """One Chrome trace of every rank (each rank is already its own process)."""
    events = [e for d in docs for e in d["traceEvents"]]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def lanes(doc: dict) -> list[tuple[int, int, str]]:
    """(pid, tid, name) of every lane, ranks in order, the steps first."""
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    return [(p, t, names[(p, t)]) for p, t in sorted(names)]


def draw(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = lanes(doc)
    index = {(p, t): i for i, (p, t, _) in enumerate(rows)}
    kinds = sorted({e["name"] for e in doc["traceEvents"] if e.get("cat") == "communication"})
    colours = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.5))
    for e in doc["traceEvents"]:
        if e["ph"] != "X":
            continue
        y = index[(e["pid"], e["tid"])]
        step = e.get("cat") == "step"
        colour = (0.8, 0.8, 0.8) if step else colours[e["name"]]
        ax.broken_barh(
            [(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))],
            (y - 0.4, 0.8),
            color=colour,
            edgecolor="white" if step else colour,
            linewidth=0.5,
        )
    ax.set_yticks(range(len(rows)), [f"rank {p}: {name}" for p, _, name in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the timeline began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in kinds]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=(0.8, 0.8, 0.8)))
    ax.legend(handles, [*kinds, "step"], loc="upper right", fontsize="small")
    ax.set_title("jaxsync timeline: inter-process calls per rank and thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(docs: list[dict]) -> list[str]:
    lines = []
    for d in docs:
        xs = [e for e in d["traceEvents"] if e["ph"] == "X"]
        calls = [e for e in xs if e.get("cat") == "communication"]
        steps = [e for e in xs if e.get("cat") == "step"]
        busy = sum(e["dur"] for e in calls) / 1e3
        total = sum(e["dur"] for e in steps) / 1e3
        share = f", {busy / total:.0%} of the steps' {total:.1f} ms" if total else ""
        lines.append(
            f"rank {d['otherData']['rank']}: {len(calls)} calls, {len(steps)} steps, "
            f"{busy:.1f} ms in calls{share}"
        )
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync timeline",
        description="Merge the ranks' timelines (DIR/rank*.json, from jaxsync.timeline or "
        "JAXSYNC_TIMELINE=DIR) into DIR/timeline.json (Perfetto, chrome://tracing) and "
        "draw DIR/timeline.png: a lane per rank and thread.",
    )
    p.add_argument("directory", type=Path)
    p.add_argument("--no-png", action="store_true", help="write the merged trace only")
    args = p.parse_args(argv)
    docs = load(args.directory)
    doc = merge(docs)
    (args.directory / "timeline.json").write_text(json.dumps(doc))
    print(f"wrote {args.directory / 'timeline.json'}")
    if not args.no_png:
        draw(doc, args.directory / "timeline.png")
        print(f"wrote {args.directory / 'timeline.png'}")
    for line in summary(docs):
        print(line)
    return 0
