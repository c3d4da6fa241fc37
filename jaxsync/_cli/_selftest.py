"""``python -m jaxsync selftest``: what to run on a new cluster before training.

Under ``mpirun``/``srun`` (or ``python -m jaxsync cluster``), alone too. Three
parts, printed by rank 0 in tables:

1. the topology every rank sees (hosts, processes per host, devices), checked
   for agreement (every host the same size, every process the same devices);
2. every way of synchronising, one row per case, each checked against its
   closed form (the cases: ``_selftest_cases``; their check values, exact for
   any replica count: ``_selftest_values``): every strategy, ``auto_mean``,
   ``overlap=True``, ``double_buffering=True``, ``powersgd_mean`` and
   ``sign_mean``. A case passes only where it passed on every rank (a failure's
   detail is the first failing rank's). The warnings the cases raise
   (``auto_mean`` without a profile; ``overlap`` or double buffering without an
   inter-process stage, as in one process) are printed once each below the
   table;
3. each tier's bandwidth, as nccl-tests reports it: the allreduce of a buffer
   among the devices of a process (``psum``), the processes of a host (MPI over
   shared memory) and one process per host (MPI over the network), with the
   algorithm bandwidth (bytes / time) and the bus bandwidth (times 2(n-1)/n).

The exit status is non-zero on every rank when any check fails anywhere.

This module is the command line (``main``), the ranks' agreement on the results,
the tables and the bandwidths. Imports ``_selftest_cases``; inside functions the
topology (``jaxsync._comm._topology``), jax, numpy, mpi4py and rich.
"""

from __future__ import annotations

import argparse
import sys
import time

from ._selftest_cases import check_strategies


def _timed(fn, iters: int) -> float:
    fn()  # warm-up (connections, first-call costs)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bandwidths(comm, nbytes: int, iters: int) -> list[dict]:
    """The allreduce of ``nbytes`` on each tier present; collective over ``comm``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = []

    def row(tier, n, seconds):
        alg = nbytes / seconds / 1e9
        rows.append(
            dict(
                tier=tier,
                ranks=n,
                bytes=nbytes,
                ms=seconds * 1e3,
                algbw=alg,
                busbw=alg * 2 * (n - 1) / n,
            )
        )

    D = jax.local_device_count()
    if D > 1:
        mesh = Mesh(np.array(jax.local_devices()), ("local",))
        x = jax.device_put(jnp.ones((D, nbytes // 4), jnp.float32), NamedSharding(mesh, P("local")))
        f = jax.jit(
            jax.shard_map(
                lambda b: lax.psum(b, "local"), mesh=mesh, in_specs=P("local"), out_specs=P("local")
            )
        )
        seconds = _timed(lambda: jax.block_until_ready(f(x)), iters)
        if comm is not None:
            from mpi4py import MPI

            seconds = comm.allreduce(seconds, op=MPI.MAX)
        row("devices of a process (psum)", D, seconds)
    if comm is None:
        return rows
    from mpi4py import MPI

    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leaders = comm.Split(0 if host.Get_rank() == 0 else MPI.UNDEFINED, comm.Get_rank())
    tiers = [("processes of a host (MPI, shared memory)", host)]
    tiers.append(("hosts, one process each (MPI, network)", leaders))
    tiers.append(("all processes (MPI)", comm))
    for tier, c in tiers:
        n = c.Get_size() if c != MPI.COMM_NULL else 0
        n = comm.allreduce(n, op=MPI.MAX)
        if n < 2:
            continue
        seconds = 0.0
        if c != MPI.COMM_NULL:
            c.Barrier()
            seconds = _timed(lambda c=c: c.Allreduce(send, recv, op=MPI.SUM), iters)
        seconds = comm.allreduce(seconds, op=MPI.MAX)
        row(tier, n, seconds)
        comm.Barrier()
    for c in (host, leaders):
        if c != MPI.COMM_NULL:
            c.Free()
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync selftest",
        description="Check jaxsync on this cluster before training: the topology every "
        "rank sees; every strategy, auto_mean, overlap, double buffering, powersgd_mean "
        "and sign_mean on small trees against their closed forms; and each tier's "
        "allreduce bandwidth (devices of a process, processes of a host, hosts). Run under "
        "mpirun/srun with the launch you train with. Exit status non-zero on any failure.",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices per process (jax_num_cpu_devices)",
    )
    p.add_argument(
        "--mbytes", type=float, default=16.0, help="buffer of the bandwidth test in MB (default 16)"
    )
    p.add_argument(
        "--iters", type=int, default=5, help="timed allreduces per tier (median; default 5)"
    )
    args = p.parse_args(argv)
    if args.mbytes <= 0 or args.iters < 1:
        p.error("--mbytes must be > 0 and --iters >= 1")
    import jax

    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxsync._comm._topology import default_comm, topology

    comm = default_comm()
    topo = topology(comm)
    tops = [topo] if comm is None else comm.allgather(topo)
    per_host = {t.host: t.local_size for t in tops}
    problems = []
    if len(set(per_host.values())) > 1:
        problems.append(f"hosts hold different numbers of processes: {per_host}")
    if len({t.local_devices for t in tops}) > 1:
        problems.append(
            f"processes drive different numbers of devices: {[t.local_devices for t in tops]}"
        )
    cases: list[tuple[str, bool, str]] = []
    notes: list[tuple[str, str]] = []
    bws: list[dict] = []
    if not problems:  # a launch the ranks disagree on: fix that first (syncs would fail)
        cases = check_strategies(comm, notes=notes)
        if comm is not None:  # a case passes only where it passed on every rank
            cases = _agree(comm.allgather(cases))
        bws = bandwidths(comm, int(args.mbytes * 1e6) // 4 * 4, args.iters)
    failed = bool(problems) or not all(ok for _, ok, _ in cases)
    if topo.rank == 0:
        _print(tops, problems, cases, notes, bws)
        print(f"selftest {'FAILED' if failed else 'passed'}", flush=True)
    return 1 if failed else 0


def _agree(every: list) -> list[tuple[str, bool, str]]:
    """Every rank's results as one: a case passes where it passed on every rank; a
    failure's detail is the first failing rank's (``rank R: ...``)."""
    out = []
    for i, (name, _, detail) in enumerate(every[0]):
        failed = [(r, res[i][2]) for r, res in enumerate(every) if not res[i][1]]
        if failed:
            detail = f"rank {failed[0][0]}: {failed[0][1]}"
        out.append((name, not failed, detail))
    return out


def _print(tops, problems, cases, notes, bws) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    t = tops[0]
    table = Table(
        title=f"topology: {t.hosts} host(s), {t.size} process(es), {t.local_devices} device(s) each"
    )
    for c in ("rank", "host", "local_rank", "local_size", "devices", "platform"):
        table.add_column(c, justify="right")
    for x in tops:
        table.add_row(
            *(
                str(v)
                for v in (x.rank, x.host, x.local_rank, x.local_size, x.local_devices, x.platform)
            )
        )
    console.print(table)
    for msg in problems:
        console.print(f"[red]FAIL[/red] {msg}; the strategies were not run (fix the launch)")
    if not cases:
        return
    table = Table(
        title="every strategy and option against its closed form (bitwise; powersgd within "
        "float32 rounding)"
    )
    for c in ("case", "result", "detail"):
        table.add_column(c)
    for name, ok, detail in cases:
        table.add_row(name, "[green]PASS[/green]" if ok else "[red]FAIL[/red]", detail)
    console.print(table)
    for name, msg in dict.fromkeys(notes):  # once each, in order
        console.print(f"[yellow]warning[/yellow] ({name}): {msg}", markup=True, highlight=False)
    if bws:
        table = Table(title="allreduce bandwidth per tier (median; slowest rank)")
        for c in ("tier", "ranks", "MB", "ms", "algbw GB/s", "busbw GB/s"):
            table.add_column(c, justify="right" if c != "tier" else "left")
        for b in bws:
            table.add_row(
                b["tier"],
                str(b["ranks"]),
                f"{b['bytes'] / 1e6:.1f}",
                f"{b['ms']:.2f}",
                f"{b['algbw']:.3f}",
                f"{b['busbw']:.3f}",
            )
        console.print(table)
    sys.stdout.flush()


def table_rows(out: str) -> dict[str, tuple[str, str]]:
    """The strategies table of selftest's printed output: case -> (PASS or FAIL,
    detail), wrapped details joined (what the tests read)."""
    rows: dict[str, tuple[str, str]] = {}
    last = None
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("\u2502")[1:-1]]
        if len(cells) != 3:
            continue
        if cells[1] in ("PASS", "FAIL"):
            last = cells[0]
            rows[last] = (cells[1], cells[2])
        elif last is not None and not cells[0] and not cells[1]:  # a wrapped detail
            rows[last] = (rows[last][0], f"{rows[last][1]} {cells[2]}")
    return rows
