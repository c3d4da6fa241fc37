"""``python -m jaxsync tune``: calibrate the cost model; ``--project``: paper figures.

Calibration times a few sizes of each collective on each link this run can
reach, inside jitted steps the way jaxsync issues them, and fits the model
(``jaxsync._cost``) by least squares on relative error:

* ``device`` (several local devices): ``psum``, ``psum_scatter``, ``all_gather``
  and ``all_to_all`` under ``jit(shard_map)`` over the local devices;
* ``host`` or ``network`` (under ``mpirun``, several processes): jaxsync's native
  MPI allreduce, all-to-all and all-gather in a jitted step on each process's
  first device (``host`` when every process is on one host);
* ``copy``: a concatenation of 16 leaves and its slices back (what packing and
  unpacking cost).

Each time is a marginal cost (the step minus the same step without the
collective), the median of interleaved rounds, the slowest process's. The
profile (JSON) goes to ``--out`` (default ``$JAXSYNC_PROFILE`` or
``~/.cache/jaxsync/profile.json``, where ``strategy="auto"`` looks for it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import _cost
from ._cost import Link, ModelTopology, Profile

KiB, MiB = 2**10, 2**20
SIZES = (16 * KiB, 256 * KiB, 2 * MiB, 8 * MiB)
QUICK_SIZES = (16 * KiB, 1 * MiB)


def _log(rank, msg):
    if rank == 0:
        print(f"[tune] {msg}", file=sys.stderr, flush=True)


def _time_rounds(fns: dict, base_key, rounds: int, iters: int, comm=None) -> dict:
    """Marginal seconds of each fn against ``fns[base_key]``: median over rounds
    of (median of ``iters`` calls); the slowest process's per round."""
    import jax
    keys = list(fns)
    samples = np.zeros((rounds, len(keys)))
    for k in keys:  # warm up
        jax.block_until_ready(fns[k]())
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            if comm is not None:
                comm.Barrier()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fns[k]())
                ts.append(time.perf_counter() - t0)
            samples[r, keys.index(k)] = statistics.median(ts)
    if comm is not None:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    b = keys.index(base_key)
    return {k: float(np.median(samples[:, i] - samples[:, b])) for i, k in enumerate(keys)
            if k != base_key}


MULTI = 8  # buffers in one call, to tell the cost per call from the cost per message


def measure_device(devices: int, sizes, rounds: int, iters: int) -> list:
    """``(kind, nbytes, devices, seconds)`` for XLA collectives over local devices."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.local_devices()[:devices]), ("d",))
    D = devices
    out = []
    for n in sizes:
        m = max(D * MULTI, (n // 4) // (D * MULTI) * (D * MULTI))
        x = jax.device_put(jnp.ones((D, m), jnp.float32), NamedSharding(mesh, P("d")))

        def step(op):
            def body(xs):
                y = xs[0] * 1.0001 + 1.0
                return op(y)[None] if op is not None else y[None]
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"),
                                         out_specs=P("d"), check_vma=False))

        # reduce_scatter and allgather compute a slice: their base step too.
        part = {"reduce_scatter", "allgather"}
        ops = {
            "base": None,
            "base part": lambda y: y[:m // D],
            "allreduce": lambda y: lax.psum(y, "d"),
            "reduce_scatter": lambda y: lax.psum_scatter(y, "d", tiled=True),
            "allgather": lambda y: lax.all_gather(y[:m // D], "d", tiled=True),
            "alltoall": lambda y: lax.all_to_all(y.reshape(D, -1), "d", 0, 0,
                                                 tiled=True).reshape(-1),
            # one psum of MULTI buffers (one op, as sum_buffers issues it)
            "allreduce x": lambda y: jnp.concatenate(lax.psum(
                list(y.reshape(MULTI, -1)), "d")),
        }
        fns = {k: (lambda f=step(op): f(x)) for k, op in ops.items()}
        got = _time_rounds(fns, "base", rounds, iters)
        out += [(k, m * 4, D, t - (got["base part"] if k in part else 0.0))
                for k, t in got.items() if k not in ("base part", "allreduce x")]
        out.append(("allreduce", m * 4 // MULTI, D, got["allreduce x"], MULTI))
    return out


def measure_process(comm, sizes, rounds: int, iters: int) -> list:
    """``(kind, nbytes, processes, seconds)``: jaxsync's native MPI calls in jit."""
    import jax
    import jax.numpy as jnp
    from . import _mpi_backend
    from ._topology import Comms
    comms = Comms.of(comm)
    P_ = comms.size
    handle = comms.world.py2f()
    dev = jax.local_devices()[0]
    out = []
    for n in sizes:
        m = max(P_ * MULTI, (n // 4) // (P_ * MULTI) * (P_ * MULTI))
        x = jax.device_put(jnp.ones((m,), jnp.float32), dev)

        def step(kind):
            def body(x):
                y = x * 1.0001 + 1.0
                ops = _mpi_backend._NativeOps(jnp.int32(handle), jnp.int32(1), P_)
                if kind == "allreduce":
                    return ops.allreduce([y])[0]
                if kind == "alltoall":
                    return ops.alltoall(y.reshape(P_, -1)).reshape(-1)
                if kind == "allgather":
                    return ops.allgather(y[:m // P_]).reshape(-1)
                if kind == "base part":
                    return y[:m // P_]
                if kind == "allreduce x":  # one native call, MULTI buffers
                    return jnp.concatenate(ops.allreduce(list(y.reshape(MULTI, -1))))
                return y
            return jax.jit(body)

        fns = {k: (lambda f=step(k): f(x)) for k in ("base", "base part", "allreduce",
                                                     "alltoall", "allgather", "allreduce x")}
        got = _time_rounds(fns, "base", rounds, iters, comms.control)
        out += [(k, m * 4, P_, t - (got["base part"] if k == "allgather" else 0.0))
                for k, t in got.items() if k not in ("base part", "allreduce x")]
        # the native call sums buffers under 64 KiB together: count its messages
        msgs = _cost._native_messages([("f32", m * 4 // MULTI)] * MULTI)
        out.append(("allreduce", msgs[0], P_, got["allreduce x"], len(msgs)))
    return out


def measure_copy(sizes, rounds: int, iters: int) -> list:
    """``(bytes copied, seconds)``: 16 leaves packed and unpacked in a jitted step."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    out = []
    for n in sizes:
        k = 16
        m = max(1, (n // 4) // k)
        xs = [jnp.ones((m,), jnp.float32) for _ in range(k)]

        def base(xs):
            return [x * 1.0001 + 1.0 for x in xs]

        def packed(xs):
            ys = base(xs)
            (buf,) = lax.optimization_barrier((jnp.concatenate(ys),))
            return [lax.slice(buf, (i * m,), ((i + 1) * m,)) for i in range(k)]

        fb, fp = jax.jit(base), jax.jit(packed)
        got = _time_rounds({"base": lambda: fb(xs), "copy": lambda: fp(xs)}, "base",
                           rounds, iters)
        out.append((2 * k * m * 4, got["copy"]))
    return out


def measure_leaf(comm, devices: int, rounds: int, iters: int, k: int = 128) -> float:
    """Seconds per leaf of a synchronisation: ``hierarchical_mean`` in the README's
    ``jit(shard_map)`` step on ``k`` leaves of 1 KiB against one leaf of ``k`` KiB."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxsync
    mesh = Mesh(np.array(jax.local_devices()[:devices]), ("local",))
    tx = jaxsync.hierarchical_mean(axis_name="local", comm=comm)
    sh = NamedSharding(mesh, P("local"))
    many = {f"l{i:03d}": jax.device_put(jnp.ones((devices, 256), jnp.float32), sh)
            for i in range(k)}
    one = {"l": jax.device_put(jnp.ones((devices, 256 * k), jnp.float32), sh)}

    def step(sync):
        def body(t):
            g = jax.tree.map(lambda x: x[0] * 1.0001 + 1.0, t)
            if sync:
                g = tx.update(g, tx.init(g))[0]
            return jax.tree.map(lambda x: x[None], g)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("local"),
                                     out_specs=P("local")))

    fns = {"base many": (lambda f=step(False): f(many)),
           "many": (lambda f=step(True): f(many)),
           "base one": (lambda f=step(False): f(one)),
           "one": (lambda f=step(True): f(one))}
    control = None
    if comm is not None:
        from ._topology import Comms
        control = Comms.of(comm).control
    got = _time_rounds(fns, "base many", rounds, iters, control)
    got_one = got["one"] - got["base one"]
    return max(0.0, (got["many"] - got_one) / (k - 1))


def calibrate(comm=None, devices: int | None = None, quick: bool = False,
              rounds: int | None = None) -> Profile:
    """Measure and fit a profile for this run's links (collective over ``comm``)."""
    import jax
    from ._topology import topology
    D = devices or jax.local_device_count()
    topo = topology(comm)
    rank = topo.rank
    sizes = QUICK_SIZES if quick else SIZES
    rounds = rounds or (3 if quick else 4)
    iters = 5 if quick else 7
    links, fit, raw = [], {}, {}
    t0 = time.perf_counter()
    if D > 1:
        _log(rank, f"device link: {D} devices, sizes {[s // KiB for s in sizes]} KiB")
        s = measure_device(D, sizes, rounds, iters)
        link, rep = _cost.fit_link(s)
        links.append(("device", link))
        fit["device"], raw["device"] = rep, s
    if topo.size > 1:
        name = "host" if topo.hosts == 1 else "network"
        _log(rank, f"{name} link: {topo.size} processes on {topo.hosts} host(s)")
        s = measure_process(comm, sizes, rounds, iters)
        link, rep = _cost.fit_link(s)
        links.append((name, link))
        fit[name], raw[name] = rep, s
    _log(rank, "copy")
    c = measure_copy(sizes, rounds, iters)
    copy = _cost.fit_copy(c)
    _log(rank, "cost per leaf")
    leaf = measure_leaf(comm, D, rounds, iters)
    fit["leaf"] = leaf
    fit["copy"] = {"samples": len(c)}
    fit["seconds"] = round(time.perf_counter() - t0, 1)
    fit["raw"] = {k: [list(x) for x in v] for k, v in raw.items()} | {
        "copy": [list(x) for x in c]}
    links.sort(key=lambda kv: _cost.LINKS.index(kv[0]))
    return Profile(tuple(links), copy, {"processes": topo.size, "hosts": topo.hosts,
                                        "local_devices": D}, "calibrated", fit, leaf)


def print_fit(profile: Profile) -> None:
    print(f"profile (measured on {profile.topology}, {profile.fit.get('seconds')} s):")
    for name, l in profile.links:
        rep = profile.fit.get(name, {})
        print(f"  {name:<8} call {l.call * 1e6:8.2f} us  alpha {l.alpha * 1e6:8.2f} us  beta {l.beta * 1e9:7.4f} ns/B "
              f"({1 / l.beta / 1e9 if l.beta else math.inf:7.2f} GB/s)  gamma "
              f"{l.gamma * 1e9:7.4f} ns/B  | fit error median "
              f"{100 * (rep.get('median_rel_error') or 0):.0f}%, max "
              f"{100 * (rep.get('max_rel_error') or 0):.0f}% over {rep.get('samples')} "
              "samples")
    print(f"  copy     {profile.copy * 1e9:.4f} ns/B; per leaf {profile.leaf * 1e6:.2f} us")


# --------------------------------------------------------------------------
# Projection on paper
# --------------------------------------------------------------------------

def _spec(shape, dtype="float32"):
    import jax
    import jax.numpy as jnp
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def resnet50_tree() -> dict:
    """ResNet-50's parameter shapes: 161 leaves, 25.6 M float32."""
    tree = {}

    def conv(name, k, cin, cout):
        tree[name] = {"kernel": _spec((k, k, cin, cout)),
                      "bn": {"scale": _spec((cout,)), "bias": _spec((cout,))}}

    conv("stem", 7, 3, 64)
    cin = 64
    for stage, (blocks, w) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        for b in range(blocks):
            conv(f"s{stage}b{b}c1", 1, cin, w)
            conv(f"s{stage}b{b}c2", 3, w, w)
            conv(f"s{stage}b{b}c3", 1, w, 4 * w)
            if b == 0:
                conv(f"s{stage}b{b}down", 1, cin, 4 * w)
            cin = 4 * w
    tree["fc"] = {"kernel": _spec((2048, 1000)), "bias": _spec((1000,))}
    return tree


def transformer_1b_tree() -> dict:
    """A 1.0 B-parameter transformer: 18 layers, d=2048, ff=8192, 50k vocabulary, f32."""
    d, ff = 2048, 8192

    def dense(a, b):
        return {"kernel": _spec((a, b)), "bias": _spec((b,))}

    tree = {f"layer{i:02d}": {"qkv": dense(d, 3 * d), "out": dense(d, d),
                              "mlp_in": dense(d, ff), "mlp_out": dense(ff, d),
                              "ln1": {"scale": _spec((d,)), "bias": _spec((d,))},
                              "ln2": {"scale": _spec((d,)), "bias": _spec((d,))}}
            for i in range(18)}
    tree["embed"] = _spec((50304, d))
    return tree


def projection_profiles() -> dict[str, Profile]:
    """Stated link figures for the projection (GPU hosts with 8 devices each)."""
    nvlink = Link(alpha=5e-6, beta=1 / 150e9, gamma=1 / 1000e9)   # NVLink-class, GPU sums
    copy = 2 / 1000e9                                              # HBM read + write
    return {
        "100 Gb/s, 1 NIC/host": Profile(
            (("device", nvlink), ("network", Link(10e-6, 1 / 12.5e9, 1 / 1000e9, 1))),
            copy, None, "projection"),
        "400 Gb/s, 1 NIC/GPU (8 rails)": Profile(
            (("device", nvlink), ("network", Link(10e-6, 1 / 50e9, 1 / 1000e9, 8))),
            copy, None, "projection"),
    }


PROJECT_HOSTS = (8, 64, 512, 1024)


def project(hosts=PROJECT_HOSTS, devices: int = 8) -> list[dict]:
    """Predicted sync time per strategy and auto's choice, hosts x ``devices``."""
    from . import _auto
    trees = {"ResNet-50 (25.6 M f32, 161 leaves)": resnet50_tree(),
             "1 B-param transformer (f32, 217 leaves)": transformer_1b_tree()}
    rows = []
    for net, prof in projection_profiles().items():
        for tname, tree in trees.items():
            for h in hosts:
                topo = ModelTopology(processes=h, hosts=h, local_devices=devices,
                                     native=False, broadcast=True)
                c = _auto.choose(tree, topo, prof)
                best = {}
                for s, b, t, sec in c.table:
                    best[s] = min(best.get(s, math.inf), sec)
                rows.append({"network": net, "tree": tname, "hosts": h, "devices": devices,
                             "ms": {s: round(v * 1e3, 3) for s, v in best.items()},
                             "choice": c.strategy, "bucket_bytes": c.bucket_bytes,
                             "pack_threshold": c.pack_threshold})
    return rows


def projection_table(rows) -> str:
    strategies = list(rows[0]["ms"]) if rows else []
    head = "| network | tree | hosts x 8 | " + " | ".join(f"`{s}`" for s in strategies) + \
        " | auto picks |"
    lines = [head, "|" + "---|" * (4 + len(strategies))]
    for r in rows:
        cells = [f"{r['ms'][s]:.2f} ms" for s in strategies]
        lines.append(f"| {r['network']} | {r['tree']} | {r['hosts']} | " + " | ".join(cells)
                     + f" | `{r['choice']}` |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync tune",
        description="Calibrate jaxsync's cost model on this machine (a micro-benchmark "
                    "of each collective on each link; under a minute) and write the "
                    "profile that strategy='auto' uses. Run alone (one process, "
                    "--devices fake CPU devices) or under mpirun for the process link.")
    p.add_argument("--out", type=Path, default=None,
                   help="profile file (default: $JAXSYNC_PROFILE or "
                        "~/.cache/jaxsync/profile.json)")
    p.add_argument("--devices", type=int, default=None,
                   help="fake CPU devices per process (default: 8 alone, 1 under mpirun)")
    p.add_argument("--quick", action="store_true", help="two sizes, three rounds")
    p.add_argument("--project", action="store_true",
                   help="print predicted sync times and auto's choice for 8..1024 hosts x 8 "
                        "devices on ResNet-50 and a 1 B-parameter tree (no measurement)")
    p.add_argument("--json", action="store_true", help="with --project: JSON rows")
    args = p.parse_args(argv)
    if args.project:
        rows = project()
        print(json.dumps(rows, indent=1) if args.json else projection_table(rows))
        if not args.json:
            for name, prof in projection_profiles().items():
                print(f"\n{name}: " + "; ".join(
                    f"{k} alpha {l.alpha * 1e6:g} us, {1 / l.beta / 1e9:g} GB/s per flow, "
                    f"{l.flows} flow(s)" for k, l in prof.links) + ". GPU: mpi4jax, one "
                    "MPI call per buffer; one process per host.")
        return 0
    from ._bench import _mpi_world, _set_devices
    comm = _mpi_world()
    _set_devices(args.devices or (1 if comm is not None else 8))
    prof = calibrate(comm, quick=args.quick)
    if comm is not None and comm.Get_rank() != 0:
        return 0
    from ._auto import default_profile_path
    out = args.out or default_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof.to_json(), indent=1))
    print_fit(prof)
    print(f"wrote {out}")
    return 0
