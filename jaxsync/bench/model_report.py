"""``python -m jaxsync bench --suite model``'s report: the table, summary and plot.

What it is for: :func:`collect` merges the ``model-<P>x<D>.json`` files of one
output folder (one per configuration, written by ``jaxsync.bench.model``) into
``model.md`` (predicted against measured per strategy, ``auto``'s pick against the
best measured strategy, the noise floor, and how well a repeat of the
measurement agrees with it, where there is one), ``model.json`` (the summary) and
``model.png`` (:func:`plot`). The issue's accuracy criteria are reported, never
asserted.

May import: the standard library, numpy and matplotlib (inside :func:`plot`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")
PRED_TOL, PRED_SHARE = 0.25, 0.80
AUTO_TOL, AUTO_SHARE = 0.10, 0.90


def _rel_error(predicted: float, measured: float) -> float:
    """The model's criterion: ``predicted / measured - 1`` (inf for no cost measured)."""
    return (predicted - measured) / measured if measured > 0 else float("inf")


def _cases(runs: list) -> tuple[list, list]:
    """Per strategy and per ``auto``: the rows of the ``model-*.json`` runs."""
    cases, autos = [], []
    for run in runs:
        cfg = run["config"]
        for t in run["trees"]:
            for s, r in t["strategies"].items():
                err = _rel_error(r["predicted_ms"], r["measured_ms"])
                cases.append(
                    {
                        "config": cfg,
                        "tree": t["tree"],
                        "strategy": s,
                        "predicted_ms": r["predicted_ms"],
                        "measured_ms": r["measured_ms"],
                        "rel_error": err,
                        "q25_ms": r.get("q25_ms"),
                        "q75_ms": r.get("q75_ms"),
                        "ok": abs(err) <= PRED_TOL,
                    }
                )
            autos.append({"config": cfg, "tree": t["tree"], **t["auto"]})
    return cases, autos


def reproducibility(first: list, repeat: list) -> dict:
    """How well one measurement predicts the next: the cases of a first run
    against those of a repeat (same code and profiles, measured again later).

    Returns ``{"pairs", "first_within_25pct", "model_within_25pct",
    "median_repeat_over_first", "first_best_within_10pct"}``: the share of
    cases where the first run's measured cost, taken as the prediction, lies
    within 25% of the repeat's
    (the criterion the model faces; no prediction made before the measurement
    can be expected to do much better on the machine: an earlier measurement
    of the very same program is as informed as a prediction gets), the
    model's share against the repeat, and, ``auto``'s criterion, the share of
    trees where the first run's fastest strategy is within 10% of the
    repeat's fastest.

    Example:
      >>> row = lambda m, p: {"config": "2x1", "tree": "t", "strategy": "flat",
      ...                     "measured_ms": m, "predicted_ms": p}
      >>> r = reproducibility([row(1.0, 1.0)], [row(1.5, 1.0)])
      >>> r["first_within_25pct"], r["model_within_25pct"], r["median_repeat_over_first"]
      (0.0, 0.0, 1.5)
      >>> r["first_best_within_10pct"]  # one strategy: it is the fastest in both
      1.0
    """

    def key(c):
        return (c["config"], c["tree"], c["strategy"])

    again = {key(c): c for c in repeat if c["measured_ms"] > 0}
    pairs = [(c, again[key(c)]) for c in first if key(c) in again and c["measured_ms"] > 0]
    if not pairs:
        return {"pairs": 0}

    def within(pred, meas):
        return abs(_rel_error(pred, meas)) <= PRED_TOL

    # auto's criterion: the first run's fastest strategy of a tree, measured
    # in the repeat, within 10% of the repeat's fastest
    best = []
    for cfg_tree in sorted({k[:2] for k in map(key, first)}):
        mine = {c["strategy"]: c for c in first if key(c)[:2] == cfg_tree}
        later = {s: again[(*cfg_tree, s)]["measured_ms"] for s in mine if (*cfg_tree, s) in again}
        if later and set(later) == set(mine):
            pick = min(mine, key=lambda s: mine[s]["measured_ms"])
            best.append(later[pick] <= (1 + AUTO_TOL) * min(later.values()))

    return {
        "pairs": len(pairs),
        "first_within_25pct": float(
            np.mean([within(a["measured_ms"], b["measured_ms"]) for a, b in pairs])
        ),
        "model_within_25pct": float(
            np.mean([within(b["predicted_ms"], b["measured_ms"]) for _, b in pairs])
        ),
        "median_repeat_over_first": float(
            np.median([b["measured_ms"] / a["measured_ms"] for a, b in pairs])
        ),
        "first_best_within_10pct": float(np.mean(best)) if best else None,
    }


def per_config(cases: list, autos: list, repeat: list | None, meta: dict) -> list[dict]:
    """Per configuration: the model's share within 25% and ``auto``'s within 10%
    beside the noise floor of that configuration, where a repeat was measured
    (its :func:`reproducibility`: the first run taken as the prediction of the
    repeat, the first run's fastest strategy as the pick), and the load
    average at the end of the run (``meta``: ``{config: run meta}``).

    Example:
      >>> row = lambda m: {"config": "c", "tree": "t", "strategy": "flat",
      ...                  "measured_ms": m, "predicted_ms": 1.0, "ok": m == 1.0}
      >>> got = per_config([row(1.0)], [{"config": "c", "ok": True}], [row(2.0)], {})
      >>> [(g["model_within_25pct"], g["repeat_within_25pct"]) for g in got]
      [(1.0, 0.0)]
    """
    rows = []
    for cfg in dict.fromkeys(c["config"] for c in cases):
        mine = [c for c in cases if c["config"] == cfg]
        picks = [a["ok"] for a in autos if a["config"] == cfg]
        row = {
            "config": cfg,
            "cases": len(mine),
            "model_within_25pct": float(np.mean([c["ok"] for c in mine])),
            "auto_within_10pct": float(np.mean(picks)) if picks else None,
            "loadavg": (meta.get(cfg) or {}).get("loadavg"),
        }
        if repeat:
            r = reproducibility(mine, [c for c in repeat if c["config"] == cfg])
            row["repeat_within_25pct"] = r.get("first_within_25pct")
            row["model_within_25pct_of_repeat"] = r.get("model_within_25pct")
            row["repeat_best_within_10pct"] = r.get("first_best_within_10pct")
        rows.append(row)
    return rows


def _per_config_lines(rows: list) -> list[str]:
    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    lines = [
        "",
        "Per configuration (the repeat's columns are the noise floor: the first "
        "measurement taken as the prediction of the repeat, its fastest strategy as "
        "the pick; load: the machine's 1-minute load average at the end of the run):",
        "",
        "| config | cases | model within 25% | repeat within 25% of first | model within "
        "25% of repeat | auto within 10% of best | first's best within 10% in repeat | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        load = f"{r['loadavg'][0]:.1f}" if r.get("loadavg") else "-"
        cells = [
            r["config"],
            str(r["cases"]),
            pct(r["model_within_25pct"]),
            pct(r.get("repeat_within_25pct")),
            pct(r.get("model_within_25pct_of_repeat")),
            pct(r["auto_within_10pct"]),
            pct(r.get("repeat_best_within_10pct")),
            load,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def collect(out: Path) -> dict:
    """Merge ``model-*.json`` of ``out``: table, summary, plot. A repeat of the
    measurement in ``out/repeat`` (``scripts/model_accuracy.sh`` with
    ``REPEAT=1``) adds :func:`reproducibility`."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("model-*x*.json"))]
    cases, autos = _cases(runs)
    again = [json.loads(p.read_text()) for p in sorted(out.glob("repeat/model-*x*.json"))]
    again_cases = _cases(again)[0] if again else None
    repro = reproducibility(cases, again_cases) if again_cases is not None else None
    configs = per_config(cases, autos, again_cases, {r["config"]: r["meta"] for r in runs})
    share = float(np.mean([c["ok"] for c in cases])) if cases else float("nan")
    auto_share = float(np.mean([a["ok"] for a in autos])) if autos else float("nan")
    # Cases whose own measurement spreads wider than the +-25% band (IQR of the
    # rounds over the median): there, no model can be checked to 25%.
    noisy = [
        c
        for c in cases
        if c["q25_ms"] is not None
        and c["measured_ms"] > 0
        and (c["q75_ms"] - c["q25_ms"]) / c["measured_ms"] > 2 * PRED_TOL
    ]
    noisy_share = len(noisy) / len(cases) if cases else float("nan")
    # The noise floor: where auto chose exactly a strategy's program (same plan),
    # the same program was measured twice in one run (auto's row and the
    # strategy's); and the misses that the spread of their own rounds explains
    # (the prediction within 25% of the measured interquartile range).
    repeats = [
        abs(a.get("alone_ms", a["measured_ms"]) - a["strategy_ms"]) / a["strategy_ms"]
        for a in autos
        if a.get("same_program") and (a.get("strategy_ms") or 0) > 0
    ]
    misses = [c for c in cases if not c["ok"]]
    in_spread = [
        c
        for c in misses
        if c["q25_ms"] is not None
        and (1 - PRED_TOL) * c["q25_ms"] <= c["predicted_ms"] <= (1 + PRED_TOL) * c["q75_ms"]
    ]
    noise = {
        "repeat_pairs": len(repeats),
        "repeat_median_rel_diff": float(np.median(repeats)) if repeats else None,
        "repeat_max_rel_diff": float(np.max(repeats)) if repeats else None,
        "misses": len(misses),
        "misses_within_measured_spread": len(in_spread),
    }
    summary = {
        "prediction_within_25pct": share,
        "prediction_target": PRED_SHARE,
        "auto_within_10pct_of_best": auto_share,
        "auto_target": AUTO_SHARE,
        "measurements_wider_than_band": noisy_share,
        "noise": noise,
        "reproducibility": repro,
        "per_config": configs,
        "cases": cases,
        "auto": autos,
        "configs": [r["config"] for r in runs],
        "meta": [r["meta"] for r in runs],
    }
    (out / "model.json").write_text(json.dumps(summary, indent=1))
    lines = [
        "| config | tree | strategy | predicted | measured | error |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c['config']} | {c['tree']} | `{c['strategy']}` | "
            f"{c['predicted_ms']:.2f} ms | {c['measured_ms']:.2f} ms | "
            f"{100 * c['rel_error']:+.0f}%{'' if c['ok'] else ' (miss)'} |"
        )
    lines += [
        "",
        "| config | tree | auto picks | same program as | auto measured | "
        "best strategy measured | within 10% |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in autos:
        mates = ", ".join(f"`{m}`" for m in a.get("pooled_with", [])) or "-"
        lines.append(
            f"| {a['config']} | {a['tree']} | `{a['choice']}` | {mates} | "
            f"{a['measured_ms']:.2f} ms | `{a['best']}` {a['best_ms']:.2f} ms | "
            f"{'yes' if a['ok'] else 'no'} |"
        )
    pooled = [a for a in autos if a.get("pooled_with")]
    lines += [
        "",
        f"Predictions within 25% of the measured marginal cost: "
        f"{100 * share:.0f}% of {len(cases)} cases (target {100 * PRED_SHARE:.0f}%). "
        f"auto within 10% of the best measured strategy: {100 * auto_share:.0f}% "
        f"of {len(autos)} cases (target {100 * AUTO_SHARE:.0f}%). Measurements whose "
        f"interquartile range is wider than the 50% band: {100 * noisy_share:.0f}%.",
    ]
    if pooled:
        lines += [
            "",
            f"In {len(pooled)} of {len(autos)} cases auto compiled to the very program "
            "of a strategy (equal hash of the lowered module, blind only to the digest "
            'and instance number of the agreement check; "same program as"): '
            "the rounds of both rows are pooled and both show their median, so auto "
            "is judged by its pick, not by two noisy measurements of one executable.",
        ]
    if repeats:
        lines += [
            "",
            f"Noise floor: the same program measured twice in one run (auto's row "
            f"and the strategy's, each alone, where auto chose that strategy's plan; "
            f"{len(repeats)} pairs) differs by {100 * float(np.median(repeats)):.0f}% "
            f"(median), {100 * float(np.max(repeats)):.0f}% (max). Of the "
            f"{len(misses)} misses, {len(in_spread)} predict within 25% of the "
            "interquartile range of their own measured rounds (noise within the "
            "run could explain them); the others lie outside their rounds' spread: "
            "the model's, or drift between calibration and measurement, which the "
            "same-program pairs above bound.",
        ]
    if repro and repro["pairs"]:
        lines += [
            "",
            f"Reproducibility: the measurement repeated with the same code and "
            f"profiles (`repeat/`, measured after all of the above). This run's "
            f"measured cost, taken as the prediction of the repeat's, is within 25% "
            f"of it in {100 * repro['first_within_25pct']:.0f}% of {repro['pairs']} "
            "cases (an earlier measurement of the very same program is as informed "
            "as a prediction gets); the model's predictions, against the repeat: "
            f"{100 * repro['model_within_25pct']:.0f}%. The repeat over this run: "
            f"{repro['median_repeat_over_first']:.2f} (median). This run's fastest "
            "strategy of a tree, taken as the pick, is within 10% of the repeat's "
            f"fastest in {100 * (repro['first_best_within_10pct'] or 0):.0f}% of the "
            "trees (auto's criterion).",
        ]
    if len(configs) > 1 or again:
        lines += _per_config_lines(configs)
    allocs = {r["config"]: r["meta"].get("host_allocator", "default") for r in runs}
    lines += [
        "",
        "Host allocator (calibration and measurement): "
        + ", ".join(f"{k} {v}" for k, v in allocs.items())
        + " (tuned: jaxsync.tune_host_allocator(); default: glibc's defaults).",
    ]
    (out / "model.md").write_text("\n".join(lines) + "\n")
    try:
        plot(cases, out / "model.png")
    except ImportError as e:  # matplotlib is in the bench extra
        print(f"no plot: {e}", file=sys.stderr)
    return summary


def plot(cases, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 7))
    configs = list(dict.fromkeys(c["config"] for c in cases))
    markers = dict(zip(STRATEGIES, "osD^"))
    cmap = plt.get_cmap("tab10")
    for i, cfg in enumerate(configs):
        for s in STRATEGIES:
            pts = [
                c
                for c in cases
                if c["config"] == cfg and c["strategy"] == s and c["measured_ms"] > 0
            ]
            if pts:
                x = np.array([c["measured_ms"] for c in pts])
                y = np.array([c["predicted_ms"] for c in pts])
                # the measured interquartile range of the rounds: the noise
                lo = np.array([max(1e-3, c.get("q25_ms") or c["measured_ms"]) for c in pts])
                hi = np.array([c.get("q75_ms") or c["measured_ms"] for c in pts])
                ax.errorbar(
                    x,
                    y,
                    xerr=[np.maximum(x - lo, 0), np.maximum(hi - x, 0)],
                    fmt="none",
                    ecolor=cmap(i % 10),
                    alpha=0.4,
                    lw=1,
                )
                ax.scatter(
                    x,
                    y,
                    color=cmap(i % 10),
                    marker=markers[s],
                    s=30,
                    label=cfg if s == "hierarchical" else None,
                )
    vals = [v for c in cases for v in (c["measured_ms"], c["predicted_ms"]) if v > 0]
    if vals:
        lo, hi = min(vals) / 1.5, max(vals) * 1.5
        xs = np.geomspace(lo, hi, 50)
        ax.plot(xs, xs, "k-", lw=1)
        ax.fill_between(xs, xs * (1 - PRED_TOL), xs * (1 + PRED_TOL), color="0.85", zorder=0)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured marginal cost (ms, slowest rank)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title(
        "jaxsync cost model: predicted vs measured\n"
        "(o naive, s flat, D hierarchical, ^ two_dimensional; band ±25%;\n"
        "bars: interquartile range of the measured rounds)",
        fontsize=10,
    )
    ax.legend(fontsize=7, title="configuration (colour)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
