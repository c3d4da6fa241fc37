"""``python -m jaxsync tune --project`` with a question: the user's tree and cluster.

What it is for: the arguments (:func:`add_args`) and the answer
(:func:`answer`): for each host count, each strategy's sync time on the path
jaxsync runs on GPUs (mpi4jax), a NCCL-backed flat all-reduce beside it, the
time a step loses blocking / overlapped / double-buffered and the step
efficiency, and what ``auto`` would pick; ``--json`` for the same as data.
``--every H`` (local updates) and ``--wire-bits 8|4`` are placeholders until
those features land: they divide the bytes (or the sync) and say so.

May import: the standard library, ``_project``, ``_project_model``,
``_project_trees``, ``_cost_ops``, ``_choose``, ``_published``;
``jaxsync._core._overlap`` (overlap's default bucket) inside :func:`question`.
"""

from __future__ import annotations

import json
import math

QUESTION = ("tree", "params", "tree_file", "hosts", "compute_ms", "every", "wire_bits")


def add_args(p) -> None:
    """The question's arguments on ``tune``'s parser (all go with --project)."""
    g = p.add_argument_group("tune --project: your cluster (defaults in brackets)")
    g.add_argument("--tree", default=None, help="a named tree (resnet50, transformer1b, ...)")
    g.add_argument("--params", type=float, default=None, help="a parameter count, e.g. 7e9")
    g.add_argument(
        "--tree-file",
        default=None,
        help="your model's tree: jaxsync.save_tree_spec(params, 'tree.json') writes it",
    )
    g.add_argument("--hosts", default=None, help="host counts, e.g. 8,64,512 [8,64,512]")
    # --devices (tune's own flag): with --project, GPUs a host [8]
    g.add_argument("--procs", type=int, default=1, help="processes a host [1]")
    g.add_argument("--intra-gbs", type=float, default=450.0, help="NVLink GB/s one way [450]")
    g.add_argument("--intra-us", type=float, default=5.0, help="MPI us/message in a host [5]")
    g.add_argument("--net-gbps", type=float, default=100.0, help="Gb/s per NIC [100]")
    g.add_argument("--rails", type=int, default=1, help="NICs per host [1]")
    g.add_argument("--net-us", type=float, default=7.45, help="us/message across hosts [7.45]")
    g.add_argument("--net-eff", type=float, default=0.96, help="share of line rate [0.96]")
    g.add_argument("--pcie-gbs", type=float, default=25.0, help="device<->host GB/s [25]")
    g.add_argument("--cuda-aware", action="store_true", help="MPI reads GPU memory")
    g.add_argument("--compute-ms", type=float, default=None, help="a step's compute, ms")
    g.add_argument("--backward-share", type=float, default=2 / 3, help="backward's share [2/3]")
    g.add_argument("--every", type=int, default=None, help="placeholder: sync every H steps")
    g.add_argument("--wire-bits", type=int, default=None, choices=(16, 8, 4))
    g.add_argument("--backend", choices=("gpu", "cpu"), default="gpu")


def asked(args) -> bool:
    return any(getattr(args, k, None) is not None for k in QUESTION)


def _cluster(args, hosts):
    from ._project_model import Cluster

    return Cluster(
        hosts=hosts,
        devices=args.devices or 8,
        procs=args.procs,
        intra_gbs=args.intra_gbs,
        intra_us=args.intra_us,
        net_gbps=args.net_gbps,
        rails=args.rails,
        net_us=args.net_us,
        net_eff=args.net_eff,
        pcie_gbs=args.pcie_gbs,
        cuda_aware=args.cuda_aware,
    )


def _hosts(text) -> list[int]:
    try:
        got = [int(h) for h in str(text or "8,64,512").split(",")]
    except ValueError:
        got = []
    if not got or min(got) < 1:
        raise SystemExit(f"jaxsync tune: --hosts must be integers >= 1 like 8,64,512, got {text!r}")
    return got


def question(args, profile=None) -> dict:
    """The answer as data (what ``--json`` prints)."""
    import jax

    from jaxsync._core._overlap import OVERLAP_BUCKET_BYTES

    from ._choose import choose
    from ._cost_ops import ModelTopology
    from ._project_model import exposed, mpi_profile, nccl_allreduce
    from ._project_trees import load_tree

    try:
        tree, label = load_tree(args.tree, args.params, args.tree_file)
    except ValueError as e:
        raise SystemExit(f"jaxsync tune: {e}") from None
    leaves = jax.tree.leaves(tree)
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    elems = sum(math.prod(x.shape) for x in leaves)
    compute = None if args.compute_ms is None else args.compute_ms * 1e-3
    bits = args.wire_bits
    out: dict = {"tree": label, "bytes": nbytes, "rows": [], "notes": []}
    for h in _hosts(args.hosts):
        c = _cluster(args, h)
        try:
            c.check()
        except ValueError as e:
            raise SystemExit(f"jaxsync tune: {e}") from None
        prof = mpi_profile(c) if profile is None else _merged(profile, mpi_profile(c))
        native = args.backend == "cpu"
        staging = "device" if (native or c.cuda_aware) else "host"
        topo = ModelTopology(
            processes=h * c.procs,
            hosts=h,
            local_devices=c.devices // c.procs,
            native=native,
            broadcast=True,
            staging=staging,
        )
        ch = choose(tree, topo, prof, comm_itemsize=2 if bits == 16 else None)
        best: dict = {}
        for s, bb, _t, sec, _dt in ch.table:
            if s not in best or sec < best[s][0]:
                best[s] = (sec, bb)
        wire = elems * bits / 8 if bits else nbytes
        if bits in (8, 4):  # placeholder: bytes scaled, not a format jaxsync has yet
            best = {s: (v * wire / nbytes, bb) for s, (v, bb) in best.items()}
        nccl, algo = nccl_allreduce(wire, c)
        paths = {f"{s} (mpi4jax)" if not native else s: v for s, v in best.items()}
        paths[f"nccl flat ({algo}; not in jaxsync)"] = (nccl, 64 << 20)
        row: dict = {"hosts": h, "auto": ch.strategy, "paths": {}}
        for name, (sec, _bb) in paths.items():
            cell: dict = {"sync_ms": sec * 1e3}
            # overlap's buckets: overlap_bucket_bytes' default (4 MiB), the last one
            # summed after the backward (their extra calls are not priced)
            k = max(1, math.ceil(nbytes / OVERLAP_BUCKET_BYTES))

            def lost(t, k=k):
                return {
                    k2: {"lost_ms": v["lost_s"] * 1e3, "efficiency": v["efficiency"]}
                    for k2, v in exposed(t, compute, args.backward_share, k).items()
                }

            if compute is not None:
                cell.update(lost(sec))
            if args.every:  # PLACEHOLDER: the sync's time spread over H steps
                cell["every"] = {"sync_ms": sec * 1e3 / args.every}
                if compute is not None:
                    cell["every"].update(lost(sec / args.every))
            row["paths"][name] = cell
        out["rows"].append(row)
    if bits in (8, 4):
        out["notes"].append(
            f"--wire-bits {bits}: PLACEHOLDER, {bits} bits an element on every path (no scales, "
            "no error feedback): jaxsync has no such wire format yet."
        )
    if args.every:
        out["notes"].append(
            f"--every {args.every}: PLACEHOLDER, the sync's time / {args.every} (local updates "
            "are not in jaxsync yet; their effect on convergence is not modelled)."
        )
    out["notes"].append(
        "mpi4jax: one blocking MPI call per buffer"
        + ("" if args.cuda_aware else ", each copied device->host->device (--cuda-aware: not)")
        + "; MPI's algorithm per message is the fastest of ring, recursive doubling, "
        "Rabenseifner. nccl flat: NCCL's ring or tree over all GPUs (jaxsync does not run it)."
    )
    return out


def _merged(measured, flags):
    """``measured``'s links where it has them, the flags' elsewhere (never the
    built-in CPU default's); its copy, per-leaf and per-strategy costs."""
    import dataclasses

    links = tuple(
        (k, measured.link(k) if measured.has(k) else flags.link(k))
        for k in ("device", "host", "network")
    )
    return dataclasses.replace(measured, links=links, stage=flags.stage)


def render(ans: dict, compute: bool) -> str:
    lines = [f"tree: {ans['tree']}, {ans['bytes'] / 2**20:.1f} MiB a sync"]
    for row in ans["rows"]:
        lines.append(f"\n{row['hosts']} hosts: auto picks `{row['auto']}`")
        every = any("every" in c for c in row["paths"].values())
        head = "| path | sync ms |"
        if compute:
            head += " blocking: lost ms, eff | overlap | double buffering |"
        if every:
            head += " every H (PLACEHOLDER): sync ms" + (", overlap |" if compute else " |")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for name, cell in row["paths"].items():
            line = f"| {name} | {cell['sync_ms']:.2f} |"
            if compute:
                for k in ("blocking", "overlap", "double"):
                    line += f" {cell[k]['lost_ms']:.1f}, {cell[k]['efficiency']:.0%} |"
            if every:
                e = cell["every"]
                line += f" {e['sync_ms']:.2f}" + (
                    f", {e['overlap']['efficiency']:.0%} |" if compute else " |"
                )
            lines.append(line)
    lines += [f"\nnote: {n}" for n in ans["notes"]]
    if not compute:
        lines.append("note: --compute-ms (and --backward-share) for exposed time and efficiency")
    return "\n".join(lines)


def answer(args) -> int:
    """``tune --project`` with a question: print the answer (or ``--json``)."""
    from ._project import read_profile

    profile = read_profile(args.profile) if args.profile is not None else None
    ans = question(args, profile)
    if profile is not None:
        got = [k for k in ("device", "host", "network") if profile.has(k)]
        ans["notes"].append(
            f"links measured (profile {args.profile}): {got}; the others from the flags"
        )
    print(json.dumps(ans, indent=1) if args.json else render(ans, args.compute_ms is not None))
    return 0
