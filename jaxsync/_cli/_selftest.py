"""``python -m jaxsync selftest``: what to run on a new cluster before training.

Under ``mpirun``/``srun`` (or ``python -m jaxsync cluster``), alone too. Three
parts, printed by rank 0 in tables:

1. the topology every rank sees (hosts, processes per host, devices), checked
   for agreement (every host the same size, every process the same devices);
2. every way of synchronising, one row per case, each checked against its
   closed form in the README's ``jit(shard_map)`` step over the local devices,
   its state made and passed with :func:`jaxsync.state_specs` (the
   ``comm`` of the launch passed through, so under MPI the inter-process stage
   is there):

   * every strategy (under MPI also with ``comm_dtype=bfloat16`` and
     ``staging="host"``), ``auto_mean`` (whatever it chooses from the profile it
     finds; without one it warns once), ``overlap=True`` (every buffer its own
     bucket, so the small tree travels in several) and ``double_buffering=True``:
     bitwise against the exact mean. Double buffering runs two steps: the
     first returns zeros (the state's pending gradients start at zero), the
     second the mean of the first step's gradients;
   * ``powersgd_mean(rank=2)``: two steps on a tree whose ``(16, 8)`` leaf
     ``w`` is compressed (the defaults' ``min_compression_rate``) and is, on
     replica ``r``, ``A (B0 + h_r B1)^T`` with a shared factor ``A``: rank 2 with
     the mean ``A B0^T``, which PowerSGD reproduces (step 2 too: the residuals
     keep the factor ``A``) within ``powersgd_tolerance(N)`` of ``max |A B0^T|``
     (float32 matmuls and Gram-Schmidt against the float64 product); its other
     leaves bitwise against the exact mean;
   * ``sign_mean``: two steps, bitwise against the closed form of EF-SignSGD:
     the compressed leaf ``c`` (1024 values, at least ``min_size``) is on
     replica ``r`` ``sigma m s_r`` (signs ``sigma``, magnitudes ``m`` of 1/4 and
     7/4, mean 1, ``s_r`` = 1, 2 or 3), so step 1's scale is ``s_r`` and the
     result ``mean_r(s_r sigma)``; step 2 adds the residual ``sigma s_r (m - 1)``:
     ``sigma s_r (2m - 1)``, scale ``1.5 s_r``; every sum an exact float32, the one
     division correctly rounded; the small leaves bitwise against the exact mean.

   A case passes only where it passed on every rank (a failure's detail is the
   first failing rank's). The warnings the cases raise (``auto_mean`` without a
   profile; ``overlap`` or double buffering without an inter-process stage, as
   in one process) are printed once each below the table;

3. each tier's bandwidth, as nccl-tests reports it: the allreduce of a buffer
   among the devices of a process (``psum``), the processes of a host (MPI over
   shared memory) and one process per host (MPI over the network), with the
   algorithm bandwidth (bytes / time) and the bus bandwidth (times 2(n-1)/n).

The check values are exact for any replica count ``N`` (global replica
``r = process * local devices + device``) up to ``MAX_REPLICAS``, on every path
(the predivision by a power-of-two ``N``, the sum of each stage rounded once to
its wire dtype: a process's devices, a host's processes, the hosts): element
``j`` of leaf ``i`` (sorted by name) on replica ``r`` is

* on a 32-bit wire ``c + h_r + d_rj``, with ``c = (i + 1)(t + 1)`` at step ``t``
  (0-based), ``h_r`` = +1 for the first ``N // 2`` replicas, -1 for the last
  ``N // 2`` (0 for the middle one of an odd ``N``) and ``d_rj`` = +1 on replica
  ``j mod N``, -1 on replica ``(j + 1) mod N`` (they cancel for ``N = 1``), else
  0: the mean is ``c`` and every partial sum an integer of magnitude at most
  ``N (c + 2) < 2**24``, exact in float32; a replica counted twice or missed,
  a stage skipped or a wrong division changes the result;
* on a 16-bit wire (a bfloat16 leaf, or ``comm_dtype=bfloat16``) ``d_rj``
  alone: its mean 0 is the only mean exact for every ``N`` (the wire carries the
  sum ``N m``, and for ``N`` like 257, whose odd part exceeds 255, no non-zero
  bfloat16 ``m`` has ``N m`` in bfloat16), and every partial sum is -1, 0 or 1.

The exit status is non-zero on every rank when any check fails anywhere.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

# The lossless cases' tree: leaf name -> (shape, dtype).
TREE: dict[str, tuple[tuple[int, ...], str]] = {
    "a": ((3, 5), "float32"),
    "b": ((7,), "bfloat16"),
    "c": ((1024,), "float32"),
    "d": ((), "float32"),
}
# The check values are exact up to this many replicas (N (c + 2) < 2**24, c <= 8).
MAX_REPLICAS = 2**20
# powersgd_mean: its compressed leaf and its rank.
POWERSGD_LEAF = "w"
POWERSGD_SHAPE = (16, 8)
POWERSGD_RANK = 2
# sign_mean compresses the leaves of at least min_size (default 256) values: c.
SIGN_LEAF = "c"
# overlap=True: buckets of at least this many bytes: every buffer its own bucket
# (here the float32 and the bfloat16 buffer), so the small tree travels in several.
OVERLAP_BUCKET = 1

_WIDE = "mean"  # leaf kinds: exact mean, PowerSGD's low rank, sign_mean's compressed
_LOW_RANK = "low_rank"
_SIGN = "sign"


def _check_replicas(n: int) -> None:
    if not 1 <= n <= MAX_REPLICAS:
        raise ValueError(
            f"selftest: the check values are exact for 1 to {MAX_REPLICAS} replicas, got "
            f"{n}. Fix: run selftest on at most {MAX_REPLICAS} replicas (processes x "
            "devices)."
        )


def _halves(n: int, rows: np.ndarray) -> np.ndarray:
    """``h_r``: +1 for the first ``n // 2`` replicas, -1 for the last ``n // 2``, else 0."""
    return np.where(rows < n // 2, 1, np.where(rows >= n - n // 2, -1, 0))


def _pair(n: int, rows: np.ndarray, size: int) -> np.ndarray:
    """``d_rj`` ``(len(rows), size)``: +1 on replica ``j mod n``, -1 on ``(j + 1) mod n``."""
    j = np.arange(size)
    r = rows[:, None]
    return (r == j % n).astype(np.int64) - (r == (j + 1) % n).astype(np.int64)


def exact_values(
    n: int, rows: Sequence[int], index: int, shape: tuple, dtype, step: int = 0, comm_dtype=None
) -> tuple[np.ndarray, np.ndarray]:
    """A lossless case's leaf: the values of replicas ``rows`` and their mean.

    Args:
      n: the replica count (processes x local devices), 1 to ``MAX_REPLICAS``.
      rows: global replica indices (``process * local devices + device``).
      index: the leaf's position in the tree (its name's order), 0 to 3.
      shape: the leaf's shape.
      dtype: the leaf's dtype.
      step: the step (0 or 1): the 32-bit constant is ``(index + 1)(step + 1)``.
      comm_dtype: the wire dtype (``None``: the leaf's own).

    Returns:
      ``(values, mean)``: float64 arrays ``(len(rows), *shape)`` and ``shape``,
      every value exact in ``dtype`` and on the wire, the mean exact in ``dtype``
      (see the module's docstring for why every partial sum is exact too).
    """
    import jax.numpy as jnp

    _check_replicas(n)
    if not (0 <= index <= 3 and step in (0, 1)):
        raise ValueError(
            f"selftest: exact_values takes index 0 to 3 and step 0 or 1, got index "
            f"{index}, step {step}. Fix: pass a leaf of TREE and step 0 or 1."
        )
    r = np.asarray(rows, np.int64)
    size = int(np.prod(shape, dtype=np.int64))
    pair = _pair(n, r, size)
    wire = jnp.dtype(comm_dtype if comm_dtype is not None else dtype)
    if wire.itemsize < 4 or jnp.dtype(dtype).itemsize < 4:
        values = pair.astype(np.float64)
        mean = np.zeros(shape)
    else:
        c = (index + 1) * (step + 1)
        values = (c + _halves(n, r)[:, None] + pair).astype(np.float64)
        mean = np.full(shape, float(c))
    return values.reshape(len(r), *shape), mean


# A rank-2 (16, 8) matrix per replica with the shared factor A: A (B0 + h_r B1)^T.
_A = np.array([[(i % 5) - 2, ((3 * i) % 7) - 3] for i in range(16)], np.float64)
_B0 = np.array([[(j % 3) + 1, (j % 4) - 2] for j in range(8)], np.float64)
_B1 = np.array([[1, j % 2] for j in range(8)], np.float64)


def low_rank_values(n: int, rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """PowerSGD's leaf: replica ``r``'s ``A (B0 + h_r B1)^T`` and the mean ``A B0^T``."""
    _check_replicas(n)
    h = _halves(n, np.asarray(rows, np.int64)).astype(np.float64)
    b = _B0[None] + h[:, None, None] * _B1[None]
    return np.einsum("nk,rmk->rnm", _A, b), _A @ _B0.T


def sign_values(n: int, rows: Sequence[int], size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """sign_mean's leaf (the same gradient at both steps) and step ``step``'s result.

    Replica ``r``'s value ``j`` is ``sigma m_j s_r``: ``sigma`` = -1 where ``(j + r)``
    is a multiple of 3 (else +1), ``m_j`` = 1/4 (``j`` even) or 7/4 (odd), ``s_r``
    = 1 + (r mod 3). Step 0 sends ``s_r sigma`` (scale ``s_r``: the magnitudes
    average 1), keeping ``sigma s_r (m - 1)``; step 1 compresses
    ``sigma s_r (2m - 1)``: scale ``1.5 s_r``, signs ``sigma`` (-``sigma`` where
    ``m = 1/4``). Every sum is exact in float32; the result is their sum over the
    ``n`` replicas divided by ``n`` in float32 (correctly rounded), as float64.
    """
    _check_replicas(n)
    if size % 2 or step not in (0, 1):
        raise ValueError(
            f"selftest: sign_values takes an even size and step 0 or 1, got size {size}, "
            f"step {step}. Fix: pass the sign leaf's size and step 0 or 1."
        )
    j = np.arange(size)
    m = np.where(j % 2 == 0, 0.25, 1.75)

    def parts(r):
        sigma = np.where((j[None] + r[:, None]) % 3 == 0, -1.0, 1.0)
        return sigma, (1 + r % 3).astype(np.float64)[:, None]

    sigma, s = parts(np.asarray(rows, np.int64))
    every_sigma, every_s = parts(np.arange(n, dtype=np.int64))
    if step == 0:
        sent = every_s * every_sigma
    else:
        sent = 1.5 * every_s * every_sigma * np.where(m < 1, -1.0, 1.0)
    total = sent.sum(axis=0)  # small multiples of 1/2: exact in float32 too
    want = (total.astype(np.float32) / np.float32(n)).astype(np.float64)
    return sigma * m * s, want


def powersgd_tolerance(n: int) -> float:
    """The largest error of powersgd's result over ``n`` replicas, relative to ``max |A B0^T|``.

    ``1e-5 + 4 n eps`` (``eps = 2**-23``, float32's): its float32 means over ``n``
    replicas err by up to about ``n eps`` of the terms' magnitude (measured: 0.2
    to 0.35 ``n eps`` for 8 to 1024 replicas); a wrong result is off by order 1.
    """
    return 1e-5 + 4 * n * 2.0**-23


class _Case(NamedTuple):
    """One row of the table: how to make the transform and what it must return."""

    make: Callable[[], Any]  # -> optax.GradientTransformation (called inside the try)
    kinds: dict[str, str]  # leaf name -> _WIDE, _LOW_RANK or _SIGN
    steps: int = 1
    comm_dtype: Any = None
    delayed: bool = False  # double buffering: step t returns the mean of step t - 1's
    compressed: int | None = None  # residuals the state must hold (compression)
    auto: bool = False  # describe() names the choice


def _cases(comm) -> dict[str, _Case]:
    import jax.numpy as jnp

    import jaxsync

    mpi = comm is not None
    exact = {k: _WIDE for k in TREE}

    def make(fac, **kw) -> Callable[[], Any]:
        return lambda: fac(axis_name="local", comm=comm, **kw)

    out: dict[str, _Case] = {}
    for name in ("naive", "flat", "hierarchical", "two_dimensional"):
        fac = getattr(jaxsync, f"{name}_mean")
        out[name] = _Case(make(fac), exact)
        if mpi:
            bf16 = jnp.bfloat16
            out[f"{name} bf16"] = _Case(make(fac, comm_dtype=bf16), exact, comm_dtype=bf16)
            out[f"{name} host"] = _Case(make(fac, staging="host"), exact)
    if not mpi:
        out["single_node"] = _Case(lambda: jaxsync.single_node_mean(axis_name="local"), exact)
    out["auto"] = _Case(make(jaxsync.auto_mean), exact, auto=True)
    overlap = dict(overlap=True, overlap_bucket_bytes=OVERLAP_BUCKET)
    out["hierarchical overlap"] = _Case(make(jaxsync.hierarchical_mean, **overlap), exact)
    out["hierarchical double_buffering"] = _Case(
        make(jaxsync.hierarchical_mean, double_buffering=True), exact, steps=2, delayed=True
    )
    out["flat overlap double_buffering"] = _Case(
        make(jaxsync.flat_mean, **overlap, double_buffering=True), exact, steps=2, delayed=True
    )
    out[f"powersgd rank {POWERSGD_RANK}"] = _Case(
        make(jaxsync.powersgd_mean, rank=POWERSGD_RANK),
        {**exact, POWERSGD_LEAF: _LOW_RANK},
        steps=2,
        compressed=1,
    )
    out["sign"] = _Case(make(jaxsync.sign_mean), {**exact, SIGN_LEAF: _SIGN}, steps=2, compressed=1)
    return out


def _shapes(kinds: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (POWERSGD_SHAPE, "float32") if v == _LOW_RANK else TREE[k] for k, v in kinds.items()}


def _inputs(case: _Case, n: int, rows: list[int], step: int):
    """Per leaf: this process's replicas' values (float64) and the step's expected result."""
    values, want = {}, {}
    for k, (shape, dtype) in sorted(_shapes(case.kinds).items()):
        kind = case.kinds[k]
        if kind == _LOW_RANK:
            values[k], want[k] = low_rank_values(n, rows)
        elif kind == _SIGN:
            v, want[k] = sign_values(n, rows, int(np.prod(shape)), step)
            values[k] = v.reshape(len(rows), *shape)
        else:
            idx = sorted(TREE).index(k)
            values[k], _ = exact_values(n, rows, idx, shape, dtype, step, case.comm_dtype)
            if case.delayed:
                want[k] = (
                    np.zeros(shape)
                    if step == 0
                    else exact_values(n, rows, idx, shape, dtype, step - 1, case.comm_dtype)[1]
                )
            else:
                want[k] = exact_values(n, rows, idx, shape, dtype, step, case.comm_dtype)[1]
    return values, want


def _compare(case: _Case, got: dict, want: dict, step: int, rtol: float) -> tuple[list, list]:
    """One step's results against ``want``: (what is wrong, the low-rank errors)."""
    import jax.numpy as jnp

    bad, errors = [], []
    for k in sorted(want):
        g = got[k]
        dtype = np.dtype(jnp.dtype(_shapes(case.kinds)[k][1]))
        if g.dtype != dtype:
            bad.append(f"step {step + 1} {k}: dtype {g.dtype}, want {dtype}")
            continue
        g64 = g.astype(np.float64)
        if case.kinds[k] == _LOW_RANK:
            err = float(np.max(np.abs(g64 - want[k][None]))) / float(np.max(np.abs(want[k])))
            errors.append(err)
            same = all(np.array_equal(g[d], g[0]) for d in range(len(g)))
            if not err <= rtol or not same:
                bad.append(
                    f"step {step + 1} {k}: relative error {err:.1e} (tolerance {rtol:.1e})"
                    + ("" if same else ", devices differ")
                )
            continue
        wrong = np.argwhere(~(g64 == want[k][None]).reshape(len(g), -1))
        if len(wrong):
            d, j = (int(x) for x in wrong[0])
            bad.append(
                f"step {step + 1} {k}: device {d} value {j} is {float(g64[d].reshape(-1)[j])!r}, "
                f"want {float(want[k].reshape(-1)[j])!r}"
            )
    return bad, errors


def _detail(case: _Case, tx, errors: list, rtol: float) -> str:
    if errors:
        return f"{POWERSGD_LEAF} within {max(errors):.1e} (tolerance {rtol:.1e}); rest exact"
    if case.kinds.get(SIGN_LEAF) == _SIGN:
        return f"{SIGN_LEAF}: EF-SignSGD's closed form, {case.steps} steps; rest exact"
    if case.delayed:
        return "exact: step 1 zeros, step 2 step 1's mean"
    if case.auto:
        chose = tx.describe().splitlines()[0].removeprefix("jaxsync auto: ").split(";")[0]
        return f"exact; chose {chose}"
    return "exact"


def _run_case(case: _Case, mesh, n: int, rows: list) -> tuple[bool, str]:
    """Make the case's transform, run its steps, compare: (passed, detail)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    tx = case.make()
    shapes = _shapes(case.kinds)
    params = {k: jnp.zeros(s, d) for k, (s, d) in shapes.items()}
    # The state as a user makes it: inside shard_map, split per jaxsync.state_specs.
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "local")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def body(g, s):
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), s)
        return jax.tree.map(lambda x: x[None], out), s

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("local"), specs), out_specs=(P("local"), specs))
    )
    state = init(params)
    bad: list[str] = []
    errors: list[float] = []
    if case.compressed is not None:
        held = len(getattr(state, "residual", ()))
        if held != case.compressed:
            bad.append(f"{held} leaves compressed, want {case.compressed}")
    rtol = powersgd_tolerance(n)
    sharding = NamedSharding(mesh, P("local"))
    for t in range(case.steps):
        values, want = _inputs(case, n, rows, t)
        grads = {
            k: jax.device_put(v.astype(np.dtype(jnp.dtype(shapes[k][1]))), sharding)
            for k, v in values.items()
        }
        out, state = jax.block_until_ready(step(grads, state))
        wrong, errs = _compare(case, jax.tree.map(np.asarray, out), want, t, rtol)
        bad += wrong
        errors += errs
    return not bad, "; ".join(bad) if bad else _detail(case, tx, errors, rtol)


def check_strategies(
    comm, only: Sequence[str] | None = None, notes: list | None = None
) -> list[tuple[str, bool, str]]:
    """(case, passed, detail) for every case (or those named in ``only``).

    Collective over ``comm``: every rank must run the same cases. The warnings a
    case raises (``auto_mean`` without a profile; ``overlap`` or double buffering
    without an inter-process stage) are said in its detail and appended to
    ``notes`` as ``(case, message)``, not printed.
    """
    import jax
    from jax.sharding import Mesh

    rank = 0 if comm is None else comm.Get_rank()
    size = 1 if comm is None else comm.Get_size()
    D = jax.local_device_count()
    n = D * size
    rows = [D * rank + d for d in range(D)]
    mesh = Mesh(np.array(jax.local_devices()), ("local",))
    cases = _cases(comm)
    if only is not None:
        unknown = sorted(set(only) - set(cases))
        if unknown:
            raise ValueError(
                f"selftest: no case named {unknown}; the cases are {list(cases)}. Fix: name "
                "cases from that list."
            )
        cases = {k: v for k, v in cases.items() if k in only}
    results = []
    for name, case in cases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            try:
                ok, detail = _run_case(case, mesh, n, rows)
            except Exception as e:  # noqa: BLE001 - reported as a failed case
                ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        warned = [w for w in caught if issubclass(w.category, UserWarning)]
        for w in caught:
            if w not in warned:  # not the cases' own: as they would have been
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if warned:
            detail += f"; {len(warned)} warning(s), below" if ok else ""
            if notes is not None:
                notes += [(name, str(w.message)) for w in warned]
        results.append((name, ok, detail[:200]))
    return results


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
