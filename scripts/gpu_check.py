"""The GPU path checked (run by scripts/gpu_check.sh under ``mpirun -n 2``).

Every check is exact by construction and compared bitwise, on every rank (a
check passes only where it passed on all of them):

- the step calls mpi4jax's targets (not jaxsync's native CPU ones);
- every strategy across the processes (naive, flat, hierarchical,
  two_dimensional), blocking and ``overlap=True``: replica r holds leaf k as
  r + k in float32, bfloat16 and float16, whose mean (n - 1)/2 + k is exact;
- ``double_buffering=True``: step 1 applies zeros, step 2 step 1's mean;
- a quantized wire (``comm_dtype=Quantized(bits=8)``): every rank the same
  bits, within the 8-bit bound of the float64 mean;
- ``sharded(optax.sgd(1.0))``: the parameters become minus the mean;
- ``broadcast_params(root=1)``: rank 1's values everywhere;
- ``local_sgd(every=2)`` with one island per process: the float64 simulation
  of its inner steps and outer means (dyadic values: exact).

Then times, the median of ``--iters`` steps after a warm-up (every rank
waits at a barrier before each), the slowest rank's: the bare mpi4jax
allreduce and an XLA ``psum`` over this process's devices (NCCL on GPU; with
one GPU a single-device psum: the in-process floor, not a NCCL ring) beside
each synchronisation of one float32 leaf, as the README's step writes it
(``tx.update`` inside ``jax.jit``).

Writes a Markdown table to ``--out`` (rank 0) and exits 1 when any check
failed. On CPU (the dry run: ``JAXSYNC_TESTING_MPI4JAX=1``) it takes the same
mpi4jax path through mpi4jax's CPU bridge.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jaxsync

STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _bits(x) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


class Check:
    def __init__(self, comm):
        self.comm, self.rows, self.bad = comm, [], 0

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        ok = self.comm.allreduce(bool(ok), op=MPI.LAND)
        self.bad += not ok
        self.rows.append((name, "PASS" if ok else "FAIL", detail))
        if self.comm.Get_rank() == 0:
            print(f"{name:44s} {'PASS' if ok else 'FAIL'} {detail}", flush=True)

    def run(self, name, fn) -> None:
        try:
            ok, detail = fn()
        except Exception as e:  # one check's failure must not hide the others
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        self.record(name, ok, detail)


def checks(comm, ck: Check) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    tree = {f"k{k}": jnp.full((1000 + k,), rank + k, DTYPES[k % 3]) for k in range(6)}
    want = {k: np.full(v.shape, (n - 1) / 2 + int(k[1:]), v.dtype) for k, v in tree.items()}

    def exact(out):
        wrong = [k for k in want if not np.array_equal(_bits(out[k]), _bits(want[k]))]
        return not wrong, f"wrong leaves {wrong}" if wrong else ""

    def path():
        tx = jaxsync.flat_mean(axis_name=None, comm=comm)
        hlo = jax.jit(lambda g: tx.update(g, tx.init(g))[0]).lower(tree).as_text()
        ok = "mpi_allreduce" in hlo and "jaxsync_allreduce" not in hlo
        callback = "python_gpu_callback" in hlo or "python_cpu_callback" in hlo
        return ok, f"mpi4jax's targets {ok}; a host callback (the agreement) {callback}"

    ck.run("the step calls mpi4jax", path)
    for s in STRATEGIES:
        for opts in ({}, {"overlap": True}):

            def one(s=s, opts=opts):
                tx = getattr(jaxsync, f"{s}_mean")(axis_name=None, comm=comm, **opts)
                return exact(jax.jit(lambda g: tx.update(g, tx.init(g))[0])(tree))

            ck.run(f"{s}_mean {opts or ''}", one)

    def double_buffering():
        tx = jaxsync.hierarchical_mean(axis_name=None, comm=comm, double_buffering=True)
        step = jax.jit(tx.update)
        s = tx.init(tree)
        u1, s = step(tree, s)
        u2, s = step(jax.tree.map(lambda x: x * 0, tree), s)
        zeros = all(not np.any(np.asarray(v, np.float32)) for v in u1.values())
        ok, detail = exact(u2)
        return zeros and ok, ("" if zeros else "step 1 not zeros ") + detail

    ck.run("hierarchical_mean double_buffering=True", double_buffering)

    def quantized():
        g = {"w": jnp.asarray(np.linspace(-1, 1, 4096) * (rank + 1), jnp.float32)}
        tx = jaxsync.flat_mean(axis_name=None, comm=comm, comm_dtype=jaxsync.Quantized(bits=8))
        out = np.asarray(jax.jit(lambda g: tx.update(g, tx.init(g))[0])(g)["w"])
        ref = np.linspace(-1, 1, 4096) * np.mean(np.arange(1, n + 1))
        err = float(np.max(np.abs(out - ref)))
        bound = 2.0 * n / 127  # each rank's 8-bit rounding of max|x| <= n, twice
        same = comm.allgather(_bits(out).tobytes())
        agree = len(set(same)) == 1
        return (
            err <= bound and agree,
            f"max error {err:.2e} (bound {bound:.2e}), ranks agree {agree}",
        )

    ck.run("flat_mean comm_dtype=Quantized(bits=8)", quantized)

    def sharded():
        tx = jaxsync.sharded(optax.sgd(1.0), axis_name=None, comm=comm)
        params = jax.tree.map(jnp.zeros_like, tree)
        u, _ = jax.jit(tx.update)(tree, tx.init(params), params)
        new = optax.apply_updates(params, u)
        return exact(jax.tree.map(lambda x: -x, new))

    ck.run("sharded(optax.sgd(1.0))", sharded)

    def broadcast():
        out = jaxsync.broadcast_params(tree, root=1, comm=comm)
        one = {k: np.full(v.shape, 1 + int(k[1:]), v.dtype) for k, v in tree.items()}
        wrong = [k for k in one if not np.array_equal(_bits(out[k]), _bits(one[k]))]
        return not wrong, f"wrong leaves {wrong}" if wrong else ""

    ck.run("broadcast_params(root=1)", broadcast)

    def local():
        c = np.asarray([3.0, -5.0, 1.0, 7.0, -2.0, 4.0], np.float64)[: 2 * n].reshape(n, 2)
        isl = jaxsync.islands("process", axis_name=None, comm=comm)
        inner = optax.chain(
            jaxsync.hierarchical_mean(axis_name=None, comm=isl.comm), optax.sgd(0.5)
        )
        tx = jaxsync.local_sgd(inner, 2, islands=isl)
        p = {"x": jnp.asarray([4.0, -2.0], jnp.float32)}
        s = tx.init(p)

        @jax.jit
        def step(p, s):
            u, s = tx.update({"x": p["x"] - jnp.asarray(c[rank], jnp.float32)}, s, p)
            return optax.apply_updates(p, u), s

        ref = np.tile(np.asarray([4.0, -2.0]), (n, 1))
        wrong = []
        for t in range(1, 7):
            p, s = step(p, s)
            ref = ref - 0.5 * (ref - c)
            if t % 2 == 0:
                ref[:] = ref.mean(axis=0)
            if not np.array_equal(np.asarray(p["x"]), ref[rank].astype(np.float32)):
                wrong.append(t)
        return not wrong, f"wrong at steps {wrong}" if wrong else ""

    ck.run("local_sgd(every=2), one island a process", local)


def _median(comm, f, x, iters) -> float:
    jax.block_until_ready(f(x))
    times = []
    for _ in range(iters):
        comm.Barrier()
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
    return comm.allreduce(sorted(times)[len(times) // 2], op=MPI.MAX)  # the slowest rank


def timings(comm, mibs, iters) -> list[tuple[str, str, str]]:
    import mpi4jax

    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    psum = jax.jit(
        jax.shard_map(lambda v: lax.psum(v, "d"), mesh=mesh, in_specs=P(), out_specs=P())
    )
    rows = []
    for mib in mibs:
        x = jnp.ones(mib * 2**18, jnp.float32)
        bare = _median(
            comm, jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm)[0]), x, iters
        )
        rows.append((f"{mib} MiB", "mpi4jax allreduce (bare)", f"{bare * 1e3:.2f} ms (1.00x)"))
        t = _median(comm, psum, x, iters)
        rows.append(
            (f"{mib} MiB", f"XLA psum over {mesh.size} local device(s)", f"{t * 1e3:.2f} ms")
        )
        cases = [(f"{s}_mean", s, {}) for s in STRATEGIES] + [
            ("hierarchical_mean overlap=True", "hierarchical", {"overlap": True}),
            ("hierarchical_mean double_buffering=True", "hierarchical", {"double_buffering": True}),
            ("flat_mean comm_dtype=bfloat16", "flat", {"comm_dtype": jnp.bfloat16}),
            (
                "flat_mean comm_dtype=Quantized(8)",
                "flat",
                {"comm_dtype": jaxsync.Quantized(bits=8)},
            ),
        ]
        for name, s, opts in cases:
            tx = getattr(jaxsync, f"{s}_mean")(axis_name=None, comm=comm, **opts)
            state = tx.init({"x": x})
            step = jax.jit(lambda g, tx=tx, state=state: tx.update(g, state)[0])
            t = _median(comm, step, {"x": x}, iters)
            rows.append((f"{mib} MiB", name, f"{t * 1e3:.2f} ms ({t / bare:.2f}x)"))
            if comm.Get_rank() == 0:
                print(f"{mib} MiB {name:44s} {rows[-1][2]}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.md")
    ap.add_argument("--mib", type=int, nargs="*", default=[4, 64])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    dev = jax.devices()[0]
    head = (
        f"{comm.Get_size()} processes, {len(jax.local_devices())} device(s) each: "
        f"{dev.platform} {dev.device_kind}; jax {jax.__version__}, jaxsync {jaxsync.__version__}"
    )
    if comm.Get_rank() == 0:
        print("gpu_check:", head, flush=True)
    ck = Check(comm)
    checks(comm, ck)
    rows = timings(comm, args.mib, args.iters) if args.mib else []
    if comm.Get_rank() == 0:
        lines = [f"# gpu_check: {head}", "", "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in ck.rows]
        if rows:
            lines += [
                "",
                f"Times: median of {args.iters} steps, the slowest rank; "
                "(x): against the bare mpi4jax allreduce of the same bytes.",
                "",
                "| size | what | time |",
                "|---|---|---|",
            ]
            lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(
            f"gpu_check: {len(ck.rows) - ck.bad}/{len(ck.rows)} checks passed; table in {args.out}"
        )
    return 1 if ck.bad else 0


if __name__ == "__main__":
    sys.exit(main())
