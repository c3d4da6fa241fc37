"""selftest's cases: every way of synchronising, one row of the table each, run
in the README's ``jit(shard_map)`` step over the local devices and checked
against its closed form.

Each case's state is made and passed with :func:`jaxsync.state_specs` (the
``comm`` of the launch passed through, so under MPI the inter-process stage is
there); its gradients and expected results are ``_selftest_values``'s:

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

The warnings a case raises are recorded, not printed (``_selftest`` prints them
below the table). Imports ``_selftest_values``, numpy, and inside functions jax
and jaxsync's public API (looked up when a case is made, so a test can replace a
factory).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._selftest_values import (
    POWERSGD_LEAF,
    POWERSGD_RANK,
    POWERSGD_SHAPE,
    SIGN_LEAF,
    TREE,
    exact_values,
    low_rank_values,
    powersgd_tolerance,
    sign_values,
)

# overlap=True: buckets of at least this many bytes: every buffer its own bucket
# (here the float32 and the bfloat16 buffer), so the small tree travels in several.
OVERLAP_BUCKET = 1

_WIDE = "mean"  # leaf kinds: exact mean, PowerSGD's low rank, sign_mean's compressed
_LOW_RANK = "low_rank"
_SIGN = "sign"


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
