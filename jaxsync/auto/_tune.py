"""``python -m jaxsync tune``: calibrate the cost model (``--project``: ``_project``).

What it is for: calibration times a few sizes of each collective on each link
this run can reach, inside jitted steps the way jaxsync issues them, and fits
the model (``jaxsync.auto._cost_fit``) by least squares on relative error:

* ``device`` (several local devices): ``psum``, ``psum_scatter``, ``all_gather``
  and ``all_to_all`` under ``jit(shard_map)`` over the local devices;
* ``host`` and ``network`` (under ``mpirun``, several processes): jaxsync's native
  MPI allreduce, all-to-all and all-gather in a jitted step on each process's
  first device, each tier on its own communicator (``jaxsync.auto._tune_tiers``):
  ``host`` among the processes of a host (shared memory, every host at once),
  ``network`` among one process per host (the hosts' leaders); the profile's
  ``topology`` records the topology, what each link was measured on
  (``"measured"``) and, inside ``python -m jaxsync cluster``, the shaped rate;
* ``copy``: a concatenation of 16 leaves and its slices back (what packing and
  unpacking cost), on every local device at once (they share the host's cores
  and memory bandwidth, as a strategy's copies do);
* per strategy, its overhead per leaf and per byte beyond what the fitted
  collectives and copies predict: whole synchronisations (the README's
  ``jit(shard_map)`` step) of three synthetic float32 trees (few large leaves,
  many small ones, few big ones; none of the bench's trees), so that what a
  whole sync does and single collectives do not show (dispatch of many ops,
  overlapping calls, page faults, oversubscribed cores) is calibrated per
  strategy on this configuration.

Each time is a marginal cost (the step minus the same step without the
collective), the median of interleaved rounds, the slowest process's. The
profile (JSON) goes to ``--out`` (default ``$JAXSYNC_PROFILE`` or
``~/.cache/jaxsync/profile.json``, where ``strategy="auto"`` looks for it).

May import: the standard library, numpy, JAX, mpi4py and ``jaxsync.auto._cost``,
``_cost_fit``, ``_auto``, ``_topology``, ``_project``, ``_tune_sync`` (the whole-sync
part of the calibration), ``_host`` (``--tune-host-allocator``; the profile records
the allocator's state), ``_tune_tiers`` (the process tiers: shared memory, network),
``_host_tier`` (its rule in this job).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import numpy as np

from jaxsync._comm._host import host_allocator_state, tune_host_allocator
from jaxsync._comm._topology import default_comm, set_cpu_devices

from . import _cost, _cost_fit, _tune_sync
from ._cost import Profile
from ._rounds import _control, _log, _time_rounds
from ._tune_tiers import MULTI  # buffers in one call (the cost per call vs per message)

KiB, MiB = 2**10, 2**20
SIZES = (16 * KiB, 256 * KiB, 2 * MiB, 8 * MiB)
QUICK_SIZES = (16 * KiB, 1 * MiB)


def measure_device(devices: int, sizes, rounds: int, iters: int) -> list:
    """``(kind, nbytes, devices, seconds)`` for XLA collectives over local devices."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.local_devices()[:devices]), ("d",))
    D = devices
    out: list = []
    for n in sizes:
        m = max(D * MULTI, (n // 4) // (D * MULTI) * (D * MULTI))
        x = jax.device_put(jnp.ones((D, m), jnp.float32), NamedSharding(mesh, P("d")))

        def step(op):
            def body(xs):
                y = xs[0] * 1.0001 + 1.0
                return op(y)[None] if op is not None else y[None]

            return jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)
            )

        # reduce_scatter and allgather compute a slice: their base step too.
        part = {"reduce_scatter", "allgather"}
        ops = {
            "base": None,
            "base part": lambda y: y[: m // D],  # noqa: B023
            "allreduce": lambda y: lax.psum(y, "d"),
            "reduce_scatter": lambda y: lax.psum_scatter(y, "d", tiled=True),
            "allgather": lambda y: lax.all_gather(y[: m // D], "d", tiled=True),  # noqa: B023
            "alltoall": lambda y: lax.all_to_all(y.reshape(D, -1), "d", 0, 0, tiled=True).reshape(
                -1
            ),
            # one psum of MULTI buffers (one op, as sum_buffers issues it)
            "allreduce x": lambda y: jnp.concatenate(lax.psum(list(y.reshape(MULTI, -1)), "d")),
        }
        fns = {k: functools.partial(step(op), x) for k, op in ops.items()}
        got = _time_rounds(fns, "base", rounds, iters)
        out += [
            (k, m * 4, D, t - (got["base part"] if k in part else 0.0))
            for k, t in got.items()
            if k not in ("base part", "allreduce x")
        ]
        out.append(("allreduce", m * 4 // MULTI, D, got["allreduce x"], MULTI))
    return out


def measure_copy(devices: int, sizes, rounds: int, iters: int, comm=None) -> list:
    """``(bytes copied per device, seconds)``: 16 leaves packed and unpacked in a
    jitted step on every local device at once (and every process, under MPI)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.local_devices()[:devices]), ("d",))
    control = _control(comm)
    out: list = []
    for n in sizes:
        k = 16
        m = max(1, (n // 4) // k)
        sh = NamedSharding(mesh, P("d"))
        xs = [jax.device_put(jnp.ones((devices, m), jnp.float32), sh) for _ in range(k)]

        def base(xs):
            return [x * 1.0001 + 1.0 for x in xs]

        def packed(xs):
            ys = base(xs)
            (buf,) = lax.optimization_barrier((jnp.concatenate(ys, axis=1),))
            return [lax.slice_in_dim(buf, i * m, (i + 1) * m, axis=1) for i in range(k)]  # noqa: B023

        def mapped(f):
            return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

        fb, fp = mapped(base), mapped(packed)
        got = _time_rounds(
            {"base": functools.partial(fb, xs), "copy": functools.partial(fp, xs)},
            "base",
            rounds,
            iters,
            control,
        )
        out.append((2 * k * m * 4, got["copy"]))
    return out


def _tiers_on(topo) -> bool | str:
    """Whether the strategies reduce over the host tier in this job: ``"auto"``
    (the default: syncs mostly 16-bit on the wire, see ``ModelTopology.tiers``),
    or ``True``/``False`` (``JAXSYNC_HOST_TIER``, or no tier in this topology)."""
    from jaxsync._comm._host_tier import effective

    return effective("auto") if 1 < topo.hosts < topo.size else False


def calibrate(
    comm=None, devices: int | None = None, quick: bool = False, rounds: int | None = None
) -> Profile:
    """Measure and fit a profile for this run's links (collective over ``comm``)."""
    import jax

    from jaxsync._comm._topology import topology

    D = devices or jax.local_device_count()
    topo = topology(comm)
    rank = topo.rank
    sizes = QUICK_SIZES if quick else SIZES
    rounds = rounds or (3 if quick else 4)
    iters = 5 if quick else 7
    links: list = []
    fit: dict = {}
    raw: dict = {}
    t0 = time.perf_counter()
    if D > 1:
        _log(rank, f"device link: {D} devices, sizes {[s // KiB for s in sizes]} KiB")
        s = measure_device(D, sizes, rounds, iters)
        link, rep = _cost_fit.fit_link(s)
        links.append(("device", link))
        fit["device"], raw["device"] = rep, s
    measured = {}
    if D > 1:
        measured["device"] = f"{D} devices of one process (XLA collectives)"
    if topo.size > 1:  # shared memory and the network, each on its own
        from ._tune_tiers import measure_tiers

        log = functools.partial(_log, rank)
        got, reports, samples, what = measure_tiers(comm, topo, sizes, rounds, iters, log)
        links += got
        fit |= reports
        raw |= samples
        measured |= what
    _log(rank, f"copy on {D} device(s) at once")
    c = measure_copy(D, sizes, rounds, iters, comm)
    copy = _cost_fit.fit_copy(c)
    fit["copy"] = {"samples": len(c)}
    links.sort(key=lambda kv: _cost.LINKS.index(kv[0]))
    hw = {
        "processes": topo.size,
        "hosts": topo.hosts,
        "local_devices": D,
        "host_allocator": host_allocator_state(),
        "per_host": max(1, -(-topo.size // topo.hosts)),
        "host_tier": _tiers_on(topo),
        "measured": measured,
    }
    from ._tune_tiers import cluster_link

    if cluster_link() is not None:  # inside `python -m jaxsync cluster`
        hw["cluster"] = cluster_link()
    prof = Profile(tuple(links), copy, hw, "calibrated", fit, 0.0)
    if D * topo.size > 1:
        from ._tune_sync import calibrate

        log = functools.partial(_log, rank)
        prof, reports, samples = calibrate(comm, D, quick, rounds, iters, topo, prof, log)
        fit |= reports
        raw |= samples
    fit["seconds"] = round(time.perf_counter() - t0, 1)
    fit["raw"] = {k: [list(x) for x in v] for k, v in raw.items()} | {"copy": [list(x) for x in c]}
    return prof


def print_fit(profile: Profile) -> None:
    fit = profile.fit or {}
    print(f"profile (measured on {profile.topology}, {fit.get('seconds')} s):")
    for name, lk in profile.links:
        rep = fit.get(name, {})
        gbs = 1 / lk.beta / 1e9 if lk.beta else math.inf
        print(
            f"  {name:<8} call {lk.call * 1e6:8.2f} us  alpha {lk.alpha * 1e6:8.2f} us  "
            f"beta {lk.beta * 1e9:7.4f} ns/B ({gbs:7.2f} GB/s)  gamma "
            f"{lk.gamma * 1e9:7.4f} ns/B  | fit error median "
            f"{100 * (rep.get('median_rel_error') or 0):.0f}%, max "
            f"{100 * (rep.get('max_rel_error') or 0):.0f}% over {rep.get('samples')} "
            "samples"
        )
        what = (profile.topology or {}).get("measured", {}).get(name)
        if what:
            print(f"           measured on {what}")
    cl = (profile.topology or {}).get("cluster")
    if cl and cl.get("rate_bps") and profile.has("network"):
        gbit = 8 / profile.link("network").beta / 1e9
        print(
            f"  emulated cluster: links shaped to {cl['link']}; the network link's fitted "
            f"bandwidth is {gbit:.3f} Gbit/s, {gbit * 1e9 / cl['rate_bps']:.2f}x the rate"
        )
    print(f"  copy     {profile.copy * 1e9:.4f} ns/B per device (all devices at once)")
    for name, (per_leaf, per_byte) in profile.overheads:
        rep = fit.get("overheads", {}).get(name, {})
        print(
            f"  {name:<16} overhead {per_leaf * 1e6:+8.2f} us/leaf {per_byte * 1e9:+8.4f} ns/B"
            f" | whole-sync error median {100 * rep.get('median_rel_error_before', 0):.0f}%"
            f" -> {100 * rep.get('median_rel_error', 0):.0f}% over {rep.get('samples')} trees"
        )
    for line in _tune_sync.format_overheads16(profile):
        print(line)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync tune",
        description="Calibrate jaxsync's cost model on this machine (a micro-benchmark "
        "of each collective on each link and whole syncs per strategy; 13-80 s on an "
        "idle 2-core machine) and write the "
        "profile that strategy='auto' uses. Run alone (one process, "
        "--devices fake CPU devices) or under mpirun for the process links: shared "
        "memory among the processes of a host, the network among one process per host "
        "(across hosts: on a real cluster, or inside `python -m jaxsync cluster`).",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="profile file (default: $JAXSYNC_PROFILE or ~/.cache/jaxsync/profile.json)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices per process (default: 8 alone, 1 under mpirun); "
        "with --project: GPUs a host (default 8)",
    )
    p.add_argument("--quick", action="store_true", help="two sizes, three rounds")
    p.add_argument(
        "--tune-host-allocator",
        action="store_true",
        help="call jaxsync.tune_host_allocator() first and calibrate with it (the "
        "profile records which: use it in processes that call it too)",
    )
    p.add_argument(
        "--project",
        action="store_true",
        help="print predicted sync times and auto's choice for 8..1024 hosts x 8 "
        "devices on ResNet-50 and a 1 B-parameter tree (no measurement): with stated "
        "link figures, or with --profile's measured figures where it has them",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="with --project: a profile written by tune (e.g. inside `python -m jaxsync "
        "cluster`); its measured links, copy and overheads replace the stated figures, "
        "and the output says which figures are measured and which assumed",
    )
    p.add_argument("--json", action="store_true", help="with --project: JSON rows")
    p.add_argument(
        "--accuracy",
        action="store_true",
        help="print the projection against the published figures (published.json)",
    )
    from . import _project_cli

    _project_cli.add_args(p)
    args = p.parse_args(argv)
    if args.accuracy:
        from ._published import accuracy_table

        print(accuracy_table())
        return 0
    if _project_cli.asked(args) and not args.project:
        p.error("--tree/--params/--tree-file/--hosts/--compute-ms go with --project")
    if args.profile is not None and not args.project:
        p.error("--profile goes with --project (to calibrate, use --out)")
    if args.project:
        from ._project import run_project

        if _project_cli.asked(args):
            return _project_cli.answer(args)
        return run_project(args.profile, args.json, native=args.backend == "cpu")
    if args.tune_host_allocator and not tune_host_allocator():
        raise SystemExit(
            "jaxsync tune: --tune-host-allocator needs glibc (mallopt); this C library "
            "is not glibc. Run without it."
        )
    comm = default_comm()  # what comm='auto' resolves to
    set_cpu_devices(args.devices or (1 if comm is not None else 8), "tune")
    prof = calibrate(comm, quick=args.quick)
    if comm is not None and comm.Get_rank() != 0:
        return 0
    from ._profiles import default_profile_path

    out = args.out or default_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof.to_json(), indent=1))
    print_fit(prof)
    print(f"wrote {out}")
    return 0
