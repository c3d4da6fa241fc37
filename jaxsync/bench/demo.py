"""``python -m jaxsync demo``: data-parallel training of a small classifier.

The parent process relaunches itself under ``mpirun -n P``; every process
drives ``D`` fake CPU devices. The data are scikit-learn's bundled handwritten
digits (1797 8x8 images, shipped inside the wheel: no download). Every step
draws one global batch with a shared seed; process ``p`` takes its slice and
shards it over its devices. After training, rank 0 trains the same model on
one device over the whole batches and compares.

What it may import: numpy, jax, optax, mpi4py, scikit-learn, rich and ``jaxsync``
(its public API only: this is an example of using it); nothing else of
``jaxsync.bench``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time

STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync demo",
        description="Train a small MLP on the scikit-learn digits data set, data-parallel "
        "over P processes (mpirun) x D fake CPU devices, with "
        "optax.chain(jaxsync.<strategy>_mean(...), optax.adam(...)); then "
        "compare with single-process training on the whole batches.",
    )
    p.add_argument("--strategy", choices=STRATEGIES, default="hierarchical")
    p.add_argument("--processes", "-n", type=int, default=2, help="MPI processes (default 2)")
    p.add_argument(
        "--devices", "-d", type=int, default=2, help="fake CPU devices per process (default 2)"
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--comm-dtype", choices=("none", "bfloat16", "float16"), default="none")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="kill the MPI job after this many seconds"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.processes < 1 or args.devices < 1:
        print("--processes and --devices must be >= 1", file=sys.stderr)
        return 2
    replicas = args.processes * args.devices
    if args.batch % replicas:
        print(
            f"--batch {args.batch} must be divisible by processes x devices = {replicas}",
            file=sys.stderr,
        )
        return 2
    if args.worker or args.processes == 1:
        return _worker(args)
    return _launch(args, argv)


def _mpirun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.path.exists(here) else shutil.which("mpirun")
    if not found:
        raise SystemExit(
            "mpirun not found: install the MPI extra (pip install "
            "'jaxsync[mpi]'), or run with --processes 1."
        )
    return found


def _launch(args, argv) -> int:
    cmd = [
        _mpirun(),
        "-n",
        str(args.processes),
        sys.executable,
        "-m",
        "jaxsync",
        "demo",
        "--worker",
        *argv,
    ]
    print(
        f"launching: {' '.join(cmd[:3])} ... ({args.processes} processes x {args.devices} devices)",
        flush=True,
    )
    try:
        return subprocess.run(cmd, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(
            f"demo: the MPI job did not finish within {args.timeout:.0f} s; killed.",
            file=sys.stderr,
        )
        return 124


def _load_digits():
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    return x, d.target.astype(np.int32)


def _worker(args) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    jaxsync.tune_host_allocator()

    comm = None
    rank, nproc = 0, 1
    if args.processes > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, nproc = comm.Get_rank(), comm.Get_size()
        if nproc != args.processes:
            print(
                f"demo: expected {args.processes} processes, mpirun started {nproc}",
                file=sys.stderr,
            )
            return 2
    say = print if rank == 0 else (lambda *a, **k: None)
    ndev = jax.local_device_count()
    x_all, y_all = _load_digits()
    say(
        f"data: scikit-learn digits, {x_all.shape[0]} images of 8x8 px, 10 classes "
        "(bundled with scikit-learn, no download)"
    )
    say(f"replicas: {nproc} processes x {ndev} devices; strategy {args.strategy}")

    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (64, 64)) * 0.125,
            "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 10)) * 0.125,
            "b2": jnp.zeros(10),
        }

    def loss_fn(params, x, y):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # Every process starts from different random values on purpose; the
    # broadcast makes them all start from rank 0's.
    params = init(jax.random.PRNGKey(args.seed + 1000 * rank))
    params = jaxsync.broadcast_params(params, root=0, comm=comm)
    init_params = jax.tree.map(np.asarray, params)

    comm_dtype = None if args.comm_dtype == "none" else args.comm_dtype
    sync = getattr(jaxsync, f"{args.strategy}_mean")(
        axis_name="d", comm=comm, comm_dtype=comm_dtype
    )
    tx = optax.chain(sync, optax.adam(args.lr))
    mesh = Mesh(np.array(jax.devices()), ("d",))
    params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated
    opt_state = tx.init(params)

    def local_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "d")

    step = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P(), P(), P())
        )
    )
    per_proc = args.batch // nproc

    def batch(i):
        idx = np.random.default_rng(args.seed * 100003 + i).choice(
            x_all.shape[0], args.batch, replace=False
        )
        return x_all[idx], y_all[idx]

    losses, times = [], []
    progress = _progress(rank == 0, args.steps)
    with progress:
        task = progress.add_task("training", total=args.steps)
        for i in range(args.steps):
            xb, yb = batch(i)
            xs = xb[rank * per_proc : (rank + 1) * per_proc]
            ys = yb[rank * per_proc : (rank + 1) * per_proc]
            t0 = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, xs, ys)
            loss = float(loss)  # blocks: the step is done
            times.append(time.perf_counter() - t0)
            if comm is not None:
                loss = comm.allreduce(loss) / nproc
            losses.append(loss)
            progress.update(task, advance=1, description=f"training  loss {loss:.4f}")

    # Replicas: every local device's copy, and every process, bit-identical.
    local_copies = [
        b"".join(
            np.asarray(s.data).tobytes()
            for leaf in jax.tree.leaves(params)
            for s in leaf.addressable_shards
            if s.device == dev
        )
        for dev in jax.local_devices()
    ]
    devices_identical = all(c == local_copies[0] for c in local_copies)
    digest = hashlib.sha256(local_copies[0]).hexdigest()
    digests = comm.allgather(digest) if comm is not None else [digest]
    all_devices = comm.allreduce(int(devices_identical)) == nproc if comm else devices_identical
    identical = all_devices and len(set(digests)) == 1

    ok = True
    if rank == 0:
        ref, ref_losses = _reference(init_params, batch, loss_fn, args)
        diff = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref))
        )
        acc = float(
            np.mean(
                np.argmax(
                    np.tanh(x_all @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"],
                    axis=1,
                )
                == y_all
            )
        )
        moved = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(init_params))
        )
        step_ms = 1e3 * float(np.median(times[1:])) if len(times) > 1 else float("nan")
        # Summation order differs from one device, and Adam divides by sqrt(v),
        # so rounding differences grow; judge them against how far training moved
        # the parameters.
        rel = diff / moved
        tol = 1e-2 if comm_dtype is None else 5e-2
        ok = identical and rel <= tol
        _report(args, nproc, ndev, losses, ref_losses, acc, diff, rel, tol, identical, step_ms)
    if comm is not None:
        ok = comm.bcast(ok, root=0)
    return 0 if ok else 1


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        disable=not enabled,
        transient=False,
    )


def _reference(init_params, batch, loss_fn, args):
    """Single-device training on the whole batches, same data and init."""
    import jax
    import optax

    tx = optax.adam(args.lr)
    params = jax.tree.map(jax.numpy.asarray, init_params)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    losses = []
    for i in range(args.steps):
        params, state, loss = step(params, state, *batch(i))
        losses.append(float(loss))
    return params, losses


def _report(args, nproc, ndev, losses, ref_losses, acc, diff, rel, tol, identical, step_ms):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"jaxsync demo: {args.strategy}_mean, {nproc} processes x {ndev} devices")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("steps", str(args.steps))
    t.add_row("loss: first -> last", f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    t.add_row("single-process loss: last", f"{ref_losses[-1]:.4f}")
    t.add_row("training accuracy", f"{100 * acc:.1f} %")
    t.add_row("max |param - single-process param|", f"{diff:.2e}")
    t.add_row("  relative to the largest parameter change", f"{rel:.1e} (tolerance {tol:.0e})")
    t.add_row("replicas bit-identical (all devices, all processes)", "yes" if identical else "NO")
    t.add_row("time per step (median, after compile)", f"{step_ms:.1f} ms")
    Console().print(t)
    verdict = "OK" if identical and rel <= tol else "FAILED"
    print(
        f"demo {verdict}: data-parallel training {'matches' if rel <= tol else 'DIFFERS FROM'}"
        f" single-process training (max diff {diff:.2e}, {rel:.1e} of the largest "
        f"change), replicas {'bit-identical' if identical else 'DIFFER'}."
    )
