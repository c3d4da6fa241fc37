"""``python -m jaxsync tune --project``: the cost model's figures on paper.

What it is for: predicted sync times per strategy and ``auto``'s choice for 8 to
1024 hosts x 8 devices, on a ResNet-50-sized and a 1 B-parameter tree, with
stated link figures (NVLink-class inside a host; 100 and 400 Gb/s between
hosts), so a user can see where hierarchical and two-dimensional pay off
before renting the cluster. Nothing is measured.

A question about the user's own cluster (tree, hosts, links, compute time) is
``_project_cli``'s; the model it prices with ``_project_model``; the trees
``_project_trees``; the published figures it is held to ``_published``.

May import: the standard library, JAX (shapes only) and ``jaxsync.auto._cost``,
``_cost_ops``, ``_choose``, ``_project_trees``; ``_profiles`` inside
``explain_tree``, for ``info --tree``.

Example:
  >>> from jaxsync.auto import _project
  >>> rows = _project.project(hosts=(8,))
  >>> sorted({r["tree"][:9] for r in rows})
  ['1 B-param', 'ResNet-50']
"""

from __future__ import annotations

import math

from ._cost import DEFAULT_PROFILE, Link, Profile
from ._cost_ops import ModelTopology
from ._project_trees import named_trees, resnet50_tree, transformer_1b_tree

__all__ = ["named_trees", "resnet50_tree", "transformer_1b_tree"]  # re-exported

PROFILE_KEYS = ("format", "links", "copy", "topology")
"""What a profile file must have for ``--project`` (``tune`` writes them all;
``format`` carries the version)."""


def read_profile(path) -> Profile:
    """A profile file for ``--project``: an error naming what is missing (never a
    silent fall-back to the stated figures), or the profile."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        raise SystemExit(
            f"jaxsync tune: --profile {path} does not exist. Fix: write one with "
            f"`python -m jaxsync tune --out {path}` (inside `python -m jaxsync cluster` "
            "for a network link)."
        )
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise SystemExit(f"jaxsync tune: --profile {path} is not JSON ({e})") from None
    missing = [k for k in PROFILE_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise SystemExit(
            f"jaxsync tune: --profile {path} lacks {missing} (a profile needs "
            f"{list(PROFILE_KEYS)}; format 'jaxsync-profile-1'; topology may be null "
            "for one written by hand, saying so). Fix: write it with `python -m jaxsync "
            "tune --out FILE` on the cluster, or add the keys."
        )
    try:
        return Profile.from_json(data, str(path))
    except ValueError as e:
        raise SystemExit(f"jaxsync tune: --profile {e}") from None


def projection_profiles() -> dict[str, Profile]:
    """Stated link figures for the projection (GPU hosts with 8 devices each)."""
    nvlink = Link(alpha=5e-6, beta=1 / 150e9, gamma=1 / 1000e9)  # NVLink-class, GPU sums
    copy = 2 / 1000e9  # HBM read + write
    return {
        "100 Gb/s, 1 NIC/host": Profile(
            (("device", nvlink), ("network", Link(10e-6, 1 / 12.5e9, 1 / 1000e9, 1))),
            copy,
            None,
            "projection",
        ),
        "400 Gb/s, 1 NIC/GPU (8 rails)": Profile(
            (("device", nvlink), ("network", Link(10e-6, 1 / 50e9, 1 / 1000e9, 8))),
            copy,
            None,
            "projection",
        ),
    }


PROJECT_HOSTS = (8, 64, 512, 1024)


def measured_projection(profile: Profile, where: str) -> tuple[Profile, int, list]:
    """The projection's profile from a measured one (``tune --project --profile P``).

    Each figure is the measured profile's where it has it, else the stated
    figure of the 100 Gb/s projection: the device link (and the local
    devices it was measured with), the network link between hosts, the copy,
    per-leaf and per-strategy overheads.

    Returns:
      ``(profile, devices per host, [(figure, value, "measured (profile P)" or
      "assumed")])``.

    Example:
      >>> prof = Profile((("network", Link(2e-5, 8e-9, 3e-10)),), 2e-10,
      ...                {"processes": 2, "hosts": 2, "local_devices": 1})
      >>> merged, devices, figures = measured_projection(prof, "p.json")
      >>> [(f, how) for f, _, how in figures][:2]
      [('device link', 'assumed'), ('network link', 'measured (profile p.json)')]
      >>> merged.link("network") == prof.link("network"), devices
      (True, 8)
    """
    stated = projection_profiles()["100 Gb/s, 1 NIC/host"]
    yes, no = f"measured (profile {where})", "assumed"
    links, figures = [], []

    def describe(lk):
        return f"alpha {lk.alpha * 1e6:.3g} us, {1 / lk.beta / 1e9:.4g} GB/s per flow"

    # a profile read from a file is used for every figure it has (its keys are
    # checked by read_profile); only the built-in default is not a measurement
    calibrated = profile is not DEFAULT_PROFILE
    for name in ("device", "network"):
        got = calibrated and profile.has(name)
        lk = profile.link(name) if got else stated.link(name)
        links.append((name, lk))
        figures.append((f"{name} link", describe(lk), yes if got else no))
    measured_devices = profile.has("device") and (profile.topology or {}).get("local_devices")
    devices = int(measured_devices) if calibrated and measured_devices else 8
    figures.append(
        ("devices per host", str(devices), yes if devices != 8 or measured_devices else no)
    )
    copy = profile.copy if calibrated else stated.copy
    figures.append(("copy", f"{copy * 1e9:.4g} ns/B", yes if calibrated else no))
    over = ", ".join(
        f"{k} {v[0] * 1e6:+.3g} us/leaf {v[1] * 1e9:+.3g} ns/B" for k, v in profile.overheads
    )
    figures.append(("strategy overheads", over or "none", yes if profile.overheads else no))
    figures.append(("processes per host", "1", no))
    merged = Profile(
        tuple(links),
        copy,
        None,
        f"projection from {where}",
        leaf=profile.leaf,
        overheads=profile.overheads,
        overheads16=profile.overheads16,
    )
    return merged, devices, figures


def project(
    hosts=PROJECT_HOSTS, devices: int = 8, profiles: dict | None = None, native: bool = False
) -> list[dict]:
    """Predicted sync time per strategy and auto's choice, hosts x ``devices``
    (``profiles``: ``{name: Profile}``, default :func:`projection_profiles`;
    ``native``: jaxsync's native MPI target, as on CPU, else mpi4jax, as on GPU)."""
    from ._choose import choose

    trees = {
        "ResNet-50 (25.6 M f32, 161 leaves)": resnet50_tree(),
        "1 B-param transformer (f32, 217 leaves)": transformer_1b_tree(),
    }
    rows = []
    for net, prof in (profiles or projection_profiles()).items():
        for tname, tree in trees.items():
            for h in hosts:
                topo = ModelTopology(
                    processes=h, hosts=h, local_devices=devices, native=native, broadcast=True
                )
                c = choose(tree, topo, prof)
                best: dict = {}
                for s, _b, _t, sec, _dt in c.table:
                    best[s] = min(best.get(s, math.inf), sec)
                rows.append(
                    {
                        "network": net,
                        "tree": tname,
                        "hosts": h,
                        "devices": devices,
                        "ms": {s: round(v * 1e3, 3) for s, v in best.items()},
                        "choice": c.strategy,
                        "bucket_bytes": c.bucket_bytes,
                        "pack_threshold": c.pack_threshold,
                    }
                )
    return rows


def projection_table(rows) -> str:
    strategies = list(rows[0]["ms"]) if rows else []
    head = (
        f"| network | tree | hosts x {rows[0]['devices'] if rows else 8} | "
        + " | ".join(f"`{s}`" for s in strategies)
        + " | auto picks |"
    )
    lines = [head, "|" + "---|" * (4 + len(strategies))]
    for r in rows:
        cells = [f"{r['ms'][s]:.2f} ms" for s in strategies]
        lines.append(
            f"| {r['network']} | {r['tree']} | {r['hosts']} | "
            + " | ".join(cells)
            + f" | `{r['choice']}` |"
        )
    return "\n".join(lines)


def explain_tree(name: str, topo: dict, profile=None) -> str:
    """What ``strategy="auto"`` would choose for tree ``name`` on ``topo``
    (``python -m jaxsync info --tree NAME``; ``topo`` as ``Topology.as_dict()``)."""
    trees = named_trees()
    if name not in trees:
        raise SystemExit(f"jaxsync info: unknown tree {name!r}; choose from {sorted(trees)}")
    from ._choose import choose
    from ._profiles import load_profile

    prof, note = load_profile(profile)
    size = int(topo["size"])
    model = ModelTopology(
        processes=size,
        hosts=int(topo["hosts"]),
        local_devices=int(topo["local_devices"]),
        native=topo.get("platform") == "cpu" and size > 1,
        broadcast=size > 1,
    )
    return choose(trees[name](), model, prof, profile_note=note).describe()


def run_project(path, as_json: bool, native: bool = False) -> int:
    """``tune --project [--profile P]``: the fixed projection with stated figures,
    or on P's measured figures where it has them (saying which are which);
    ``native``: price jaxsync's native CPU target instead of mpi4jax (GPU)."""
    import json

    if path is None:
        rows = project(native=native)
        print(json.dumps(rows, indent=1) if as_json else projection_table(rows))
        if not as_json:
            for name, prof in projection_profiles().items():
                print(
                    f"\n{name}: "
                    + "; ".join(
                        f"{k} alpha {lk.alpha * 1e6:g} us, {1 / lk.beta / 1e9:g} GB/s per flow, "
                        f"{lk.flows} flow(s)"
                        for k, lk in prof.links
                    )
                    + ". GPU: mpi4jax, one MPI call per buffer; one process per host. "
                    "All figures assumed (stated); --profile P uses measured ones; "
                    "--tree/--params/--tree-file with --hosts, link rates and "
                    "--compute-ms ask about your own cluster."
                )
        return 0
    prof = read_profile(path)
    from pathlib import Path

    merged, devices, figures = measured_projection(prof, str(path))
    rows = project(
        devices=devices, profiles={f"measured ({Path(path).name})": merged}, native=native
    )
    if as_json:
        figs = [{"figure": f, "value": v, "source": how} for f, v, how in figures]
        print(json.dumps({"figures": figs, "rows": rows}, indent=1))
        return 0
    print(projection_table(rows))
    width = max(len(h) for *_, h in figures)
    print(f"\nfigures (one process per host, {devices} device(s) each):")
    for f, v, how in figures:
        print(f"  {f:<20} {how:<{width}}  {v}")
    print("  path                 " + ("native CPU target" if native else "mpi4jax (GPU)"))
    return 0
