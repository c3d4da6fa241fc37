"""Tests for the static packing plan (jaxsync/_core/_plan.py).

Reliability rows covered: 4 (mixed dtypes, one buffer per dtype, bit-exact
round trip), 5 (empty tree, None subtrees, int/bool/float0 leaves, scalars,
zero-size arrays), 7 (bad bucket sizes, complex leaves) and the "a plan is a
hashable value, so reuse never recompiles" rule.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxsync

# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(x) -> np.ndarray:
    """The raw bits of an array (NaN payloads, -0.0 and subnormals included)."""
    a = np.asarray(x)
    if a.dtype == bool:
        return a.view(np.uint8)
    return a.view(_UINT[a.dtype.itemsize])


def assert_tree_bitexact(got, want):
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def, f"structure changed: {got_def} != {want_def}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        name = jax.tree_util.keystr(path)
        assert jnp.dtype(g.dtype) == jnp.dtype(w.dtype), (
            f"{name}: dtype {g.dtype} != {w.dtype} (promotion?)"
        )
        assert np.shape(g) == np.shape(w), f"{name}: shape {np.shape(g)} != {np.shape(w)}"
        if w.dtype == jax.dtypes.float0:
            continue  # float0 has no data
        assert np.array_equal(_bits(g), _bits(w)), f"{name}: bits differ"


def round_trip(tree, **kw):
    plan = jaxsync.make_plan(tree, **kw)
    bufs = plan.pack(tree)
    assert len(bufs) == len(plan.buckets)
    for buf, b in zip(bufs, plan.buckets):
        # no promotion: each buffer is 1-D, of its bucket's dtype and size
        assert str(jnp.dtype(buf.dtype)) == b.dtype, (buf.dtype, b.dtype)
        assert buf.shape == (b.size,)
    return plan, plan.unpack(bufs, tree)


def special_values(dtype, shape, seed=0):
    """Random bit patterns (NaN payloads, infs, subnormals, -0.0) of ``dtype``."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(jnp.dtype(dtype))
    raw = rng.integers(0, 2 ** (8 * dt.itemsize), size=shape, dtype=np.uint64)
    return jnp.asarray(raw.astype(_UINT[dt.itemsize]).view(dt))


class Pair(NamedTuple):
    first: object
    second: object


# ----------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------

NESTED_TREES = {
    "dict_list_tuple_namedtuple": lambda: {
        "layers": [
            {
                "w": special_values(jnp.float32, (3, 4), 1),
                "b": special_values(jnp.float32, (4,), 2),
            },
            {"w": special_values(jnp.float32, (4, 2), 3), "b": None},
        ],
        "pair": Pair(
            first=special_values(jnp.bfloat16, (5,), 4),
            second=(special_values(jnp.float16, (2, 2), 5), None),
        ),
        "tuple": (jnp.float32(-0.0), jnp.float32(np.nan)),
    },
    "scalars": lambda: {
        "a": jnp.float32(1.25),
        "b": jnp.bfloat16(-3.0),
        "c": jnp.float16(np.inf),
        "d": jnp.zeros((), jnp.float32),
    },
    "zero_size": lambda: {
        "e": jnp.zeros((0,), jnp.float32),
        "f": jnp.zeros((3, 0, 2), jnp.bfloat16),
        "g": special_values(jnp.float32, (2,), 6),
    },
    "int_bool_passthrough": lambda: {
        "step": jnp.int32(7),
        "mask": jnp.array([True, False]),
        "u": jnp.arange(3, dtype=jnp.uint8),
        "i8": jnp.array([-1, 2], jnp.int8),
        "w": special_values(jnp.float32, (3,), 7),
    },
    "only_none": lambda: {"a": None, "b": [None, (None,)]},
    "bare_array": lambda: special_values(jnp.float32, (2, 3), 8),
}


@pytest.mark.parametrize("name", sorted(NESTED_TREES))
def test_round_trip_is_bit_exact(name):
    tree = NESTED_TREES[name]()
    plan, back = round_trip(tree)
    assert_tree_bitexact(back, tree)
    # every reduced, non-empty leaf is in exactly one bucket; nothing else is
    in_buckets = sorted(i for b in plan.buckets for i in b.leaves)
    want = [i for i, s in enumerate(plan.leaves) if s.reduced and s.size > 0]
    assert in_buckets == want


@pytest.mark.parametrize("pack_threshold", [None, 4, 10**9])
@pytest.mark.parametrize("bucket_bytes", [None, 1, 8, 10**9])
def test_round_trip_any_bucketing(bucket_bytes, pack_threshold):
    tree = NESTED_TREES["dict_list_tuple_namedtuple"]()
    _, back = round_trip(tree, bucket_bytes=bucket_bytes, pack_threshold=pack_threshold)
    assert_tree_bitexact(back, tree)


@pytest.mark.parametrize(
    "tree",
    [{}, [], (), None, {"a": None}, [None, {}]],
    ids=["dict", "list", "tuple", "None", "None_leaf", "nested_empty"],
)
def test_empty_trees(tree):
    plan = jaxsync.make_plan(tree)
    assert plan.buckets == ()
    assert plan.leaves == ()
    assert plan.nbytes == 0
    assert plan.pack(tree) == []
    back = plan.unpack([], tree)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)


def test_passthrough_leaves_are_classified_and_untouched():
    tree = NESTED_TREES["int_bool_passthrough"]()
    plan = jaxsync.make_plan(tree)
    reduced = {s.path: s.reduced for s in plan.leaves}
    assert reduced == {
        "['i8']": False,
        "['mask']": False,
        "['step']": False,
        "['u']": False,
        "['w']": True,
    }
    assert [b.dtype for b in plan.buckets] == ["float32"]
    back = plan.unpack(plan.pack(tree), tree)
    for k in ("step", "mask", "u", "i8"):
        assert back[k] is tree[k], f"pass-through leaf {k} was rebuilt"


def test_zero_size_leaves_take_no_buffer_space():
    tree = NESTED_TREES["zero_size"]()
    plan = jaxsync.make_plan(tree)
    assert [(b.dtype, b.size) for b in plan.buckets] == [("float32", 2)]
    assert plan.nbytes == 8


def _float0_grads():
    params = {
        "w": jnp.arange(3.0, dtype=jnp.float32),
        "n": jnp.arange(3, dtype=jnp.int32),
        "flag": jnp.array(True),
    }

    def loss(p):
        return jnp.sum(p["w"] * p["n"].astype(jnp.float32))

    grads = jax.grad(loss, allow_int=True)(params)
    assert grads["n"].dtype == jax.dtypes.float0  # precondition: jax gives float0
    return grads


def test_float0_leaves_pass_through():
    grads = _float0_grads()
    try:
        plan = jaxsync.make_plan(grads)
    except TypeError as e:
        pytest.fail(
            "BUG: make_plan rejects float0 leaves from jax.grad(allow_int=True), which the "
            f"module docstring says pass through unchanged. Got TypeError: {e}"
        )
    assert {s.path: s.reduced for s in plan.leaves} == {
        "['flag']": False,
        "['n']": False,
        "['w']": True,
    }
    back = plan.unpack(plan.pack(grads), grads)
    assert_tree_bitexact(back, grads)


def test_mixed_dtypes_one_buffer_per_dtype_no_promotion():
    with jax.enable_x64(True):
        tree = {
            "a64": special_values(jnp.float64, (3,), 1),
            "b32": special_values(jnp.float32, (2, 2), 2),
            "c16": special_values(jnp.bfloat16, (5,), 3),
            "dh": special_values(jnp.float16, (), 4),
            "e32": special_values(jnp.float32, (1,), 5),
            "f16": special_values(jnp.bfloat16, (2,), 6),
            "g64": special_values(jnp.float64, (2, 1), 7),
            "hh": special_values(jnp.float16, (3,), 8),
        }
        plan, back = round_trip(tree)
        assert_tree_bitexact(back, tree)
    # one bucket per dtype, in order of first appearance (sorted dict keys)
    assert [(b.dtype, b.size) for b in plan.buckets] == [
        ("float64", 5),
        ("float32", 5),
        ("bfloat16", 7),
        ("float16", 4),
    ]
    for b in plan.buckets:
        assert {plan.leaves[i].dtype for i in b.leaves} == {b.dtype}


def test_plan_from_shape_dtype_structs_equals_plan_from_arrays():
    tree = NESTED_TREES["dict_list_tuple_namedtuple"]()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    assert jaxsync.make_plan(abstract) == jaxsync.make_plan(tree)


def test_plan_built_from_tracers_equals_plan_from_arrays():
    tree = NESTED_TREES["dict_list_tuple_namedtuple"]()
    seen = []

    @jax.jit
    def f(t):
        seen.append(jaxsync.make_plan(t))
        return t

    f(tree)
    assert seen == [jaxsync.make_plan(tree)]


def test_pack_unpack_under_jit_is_bit_exact():
    tree = NESTED_TREES["dict_list_tuple_namedtuple"]()
    plan = jaxsync.make_plan(tree, bucket_bytes=16, pack_threshold=None)
    back = jax.jit(lambda t: plan.unpack(plan.pack(t), t))(tree)
    assert_tree_bitexact(back, tree)


# ----------------------------------------------------------------------------
# bucketing
# ----------------------------------------------------------------------------


def _check_bucket_invariants(plan, bucket_bytes, pack_threshold):
    cap = float("inf") if bucket_bytes is None else bucket_bytes
    thr = float("inf") if pack_threshold is None else pack_threshold
    seen = []
    for b in plan.buckets:
        specs = [plan.leaves[i] for i in b.leaves]
        assert all(s.dtype == b.dtype and s.reduced and s.size > 0 for s in specs)
        assert b.size == sum(s.size for s in specs)
        assert list(b.offsets) == list(np.cumsum([0] + [s.size for s in specs])[:-1])
        assert list(b.leaves) == sorted(b.leaves), "leaves out of tree order"
        if len(specs) > 1:
            assert b.nbytes <= cap, f"bucket of {b.nbytes} bytes exceeds the cap {cap}"
            assert all(s.nbytes < thr for s in specs), "a big leaf was copied into a bucket"
        seen += b.leaves
    assert sorted(seen) == [i for i, s in enumerate(plan.leaves) if s.reduced and s.size > 0]
    assert len(seen) == len(set(seen)), "a leaf is in two buckets"


def _sized_tree(sizes, dtype=jnp.float32):
    # list keeps tree order == the order given
    return [jnp.arange(n, dtype=dtype) for n in sizes]


def test_bucket_bytes_greedy_split_exact_layout():
    # f32 sizes 3,3,3,10,1 with a 32-byte (8-element) cap: [0,1] [2] [3 alone: too big] [4]
    tree = _sized_tree([3, 3, 3, 10, 1])
    plan = jaxsync.make_plan(tree, bucket_bytes=32, pack_threshold=None)
    assert [b.leaves for b in plan.buckets] == [(0, 1), (2,), (3,), (4,)]
    assert [b.offsets for b in plan.buckets] == [(0, 3), (0,), (0,), (0,)]
    _check_bucket_invariants(plan, 32, None)
    # a bucket may fill the cap exactly
    exact = jaxsync.make_plan(_sized_tree([4, 4, 1]), bucket_bytes=32, pack_threshold=None)
    assert [b.leaves for b in exact.buckets] == [(0, 1), (2,)]


@pytest.mark.parametrize("bucket_bytes", [1, 4, 12, 40, 100, None])
def test_bucket_bytes_cap_is_respected(bucket_bytes):
    sizes = [1, 7, 2, 2, 2, 30, 5, 0, 9, 1, 1, 4]
    tree = {"f": _sized_tree(sizes), "h": _sized_tree(sizes[::-1], jnp.bfloat16)}
    plan = jaxsync.make_plan(tree, bucket_bytes=bucket_bytes, pack_threshold=None)
    _check_bucket_invariants(plan, bucket_bytes, None)
    if bucket_bytes is None:
        assert len(plan.buckets) == 2  # one per dtype
    if bucket_bytes == 1:  # every non-empty leaf alone
        assert len(plan.buckets) == 2 * (len(sizes) - 1)
    _, back = round_trip(tree, bucket_bytes=bucket_bytes, pack_threshold=None)
    assert_tree_bitexact(back, tree)


def test_pack_threshold_gives_big_leaves_their_own_buffer():
    # f32 sizes (bytes): 8, 40, 4, 40 (exactly the threshold), 12; threshold 40 bytes
    tree = _sized_tree([2, 10, 1, 10, 3])
    plan = jaxsync.make_plan(tree, bucket_bytes=None, pack_threshold=40)
    assert sorted(b.leaves for b in plan.buckets) == [(0, 2, 4), (1,), (3,)]
    _check_bucket_invariants(plan, None, 40)
    # big leaves travel uncopied: their buffer is a reshape of the leaf
    jaxpr = jax.make_jaxpr(plan.pack)(tree)
    concats = [e for e in jaxpr.eqns if e.primitive.name == "concatenate"]
    assert len(concats) == 1 and len(concats[0].invars) == 3


def test_pack_threshold_none_packs_everything_and_per_leaf_splits_everything():
    tree = _sized_tree([2, 10**5, 1])
    assert [b.leaves for b in jaxsync.make_plan(tree, pack_threshold=None).buckets] == [(0, 1, 2)]
    # the 400 kB leaf gets its own buffer at once; the small ones are packed after it
    assert [b.leaves for b in jaxsync.make_plan(tree, pack_threshold=16).buckets] == [(1,), (0, 2)]
    per_leaf = jaxsync.make_plan(tree, per_leaf=True)
    assert [b.leaves for b in per_leaf.buckets] == [(0,), (1,), (2,)]


def test_default_threshold_keeps_small_leaves_together():
    tree = _sized_tree([2, 3, 4])
    plan = jaxsync.make_plan(tree)
    assert [b.leaves for b in plan.buckets] == [(0, 1, 2)]


# ----------------------------------------------------------------------------
# hashability and fingerprints
# ----------------------------------------------------------------------------


def _base_tree():
    return {
        "w": jnp.ones((2, 3), jnp.float32),
        "b": jnp.zeros(3, jnp.bfloat16),
        "l": [jnp.ones(4, jnp.float16), None],
        "step": jnp.int32(0),
    }


def test_plan_is_hashable_and_equal_when_rebuilt():
    p1, p2 = jaxsync.make_plan(_base_tree()), jaxsync.make_plan(_base_tree())
    assert p1 is not p2
    assert p1 == p2 and hash(p1) == hash(p2)
    assert len({p1, p2}) == 1
    assert p1.fingerprint == p2.fingerprint
    p3 = jaxsync.make_plan(_base_tree(), bucket_bytes=8)
    assert p3 != p1


def test_rebuilt_plan_as_static_argument_does_not_recompile():
    traces = []
    f = jax.jit(
        lambda t, plan: (traces.append(1), plan.unpack(plan.pack(t), t))[1], static_argnums=1
    )
    for _ in range(3):
        tree = _base_tree()
        f(tree, jaxsync.make_plan(tree))  # a fresh, equal plan each time
    assert len(traces) == 1, f"recompiled {len(traces)} times for equal plans"
    assert f._cache_size() == 1


def test_fingerprint_same_for_same_structure_different_values():
    t1 = _base_tree()
    t2 = jax.tree.map(lambda x: x + jnp.ones((), x.dtype), t1)
    assert jaxsync.make_plan(t1).fingerprint == jaxsync.make_plan(t2).fingerprint
    fp = jaxsync.make_plan(t1).fingerprint
    assert re.fullmatch(r"[0-9a-f]{16}", fp)


def _variant(kind):
    t = _base_tree()
    if kind == "shape_same_size":
        t["w"] = jnp.ones((3, 2), jnp.float32)
    elif kind == "shape":
        t["w"] = jnp.ones((2, 4), jnp.float32)
    elif kind == "dtype":
        t["b"] = jnp.zeros(3, jnp.float16)
    elif kind == "key":
        t["bias"] = t.pop("b")
    elif kind == "list_to_tuple":
        t["l"] = tuple(t["l"])
    elif kind == "none_to_leaf":
        t["l"] = [t["l"][0], jnp.ones(1, jnp.float32)]
    elif kind == "int_dtype":
        t["step"] = jnp.int8(0)
    elif kind == "namedtuple":
        t["l"] = Pair(*t["l"])
    return t


@pytest.mark.parametrize(
    "kind",
    [
        "shape_same_size",
        "shape",
        "dtype",
        "key",
        "list_to_tuple",
        "none_to_leaf",
        "int_dtype",
        "namedtuple",
    ],
)
def test_fingerprint_differs_for_different_plans(kind):
    base = jaxsync.make_plan(_base_tree())
    other = jaxsync.make_plan(_variant(kind))
    assert other != base
    assert other.fingerprint != base.fingerprint


def test_fingerprint_differs_for_different_bucketing():
    t = _base_tree()
    fps = {
        jaxsync.make_plan(t).fingerprint,
        jaxsync.make_plan(t, bucket_bytes=4).fingerprint,
        jaxsync.make_plan(t, per_leaf=True, pack_threshold=10**6, bucket_bytes=10**6).fingerprint,
    }
    assert len(fps) == 3


# ----------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree,path",
    [
        ({"a": {"c": jnp.ones(2, jnp.complex64)}}, "['a']['c']"),
        ([jnp.ones(2), (jnp.ones(1, jnp.complex64),)], "[1][0]"),
        (jnp.ones(3, jnp.complex64), "<root>"),
    ],
)
def test_complex_leaf_is_rejected_naming_its_path(tree, path):
    with pytest.raises(TypeError, match=re.escape(path)) as info:
        jaxsync.make_plan(tree)
    assert "complex64" in str(info.value)
    assert "Fix" in str(info.value)


@pytest.mark.parametrize("arg", ["bucket_bytes", "pack_threshold"])
@pytest.mark.parametrize(
    "value,exc",
    [
        ("1", TypeError),
        (1.5, TypeError),
        (True, TypeError),
        (2.0**20, TypeError),
        (jnp.int32(4), TypeError),
        (0, ValueError),
        (-1, ValueError),
        (np.int64(-5), ValueError),
    ],
)
def test_bad_byte_sizes(arg, value, exc):
    with pytest.raises(exc, match=arg):
        jaxsync.make_plan(_base_tree(), **{arg: value})


@pytest.mark.parametrize("arg", ["bucket_bytes", "pack_threshold"])
def test_numpy_int_byte_sizes_are_accepted(arg):
    plan = jaxsync.make_plan(_base_tree(), **{arg: np.int64(8)})
    assert plan == jaxsync.make_plan(_base_tree(), **{arg: 8})


def test_pack_and_unpack_reject_a_different_tree():
    plan = jaxsync.make_plan(_base_tree())
    with pytest.raises(ValueError, match="make_plan"):
        plan.pack({"w": jnp.ones((2, 3))})
    bufs = plan.pack(_base_tree())
    with pytest.raises(ValueError, match="buffers"):
        plan.unpack(bufs[:-1], _base_tree())


# ----------------------------------------------------------------------------
# property test
# ----------------------------------------------------------------------------

_DTYPES = ["float32", "bfloat16", "float16", "int32", "uint8", "bool"]

_leaf = st.tuples(
    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
    st.sampled_from(_DTYPES),
)


@settings(max_examples=25, deadline=None, database=None)
@given(
    leaves=st.lists(st.one_of(st.none(), _leaf), min_size=0, max_size=7),
    bucket_bytes=st.one_of(st.none(), st.integers(1, 64)),
    pack_threshold=st.one_of(st.none(), st.integers(1, 64)),
    per_leaf=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(leaves, bucket_bytes, pack_threshold, per_leaf, seed):
    tree = {}
    for k, spec in enumerate(leaves):
        if spec is None:
            tree[f"n{k}"] = None
            continue
        shape, dtype = spec
        if dtype == "bool":
            leaf = jnp.asarray(np.random.default_rng(seed + k).integers(0, 2, shape).astype(bool))
        else:
            leaf = special_values(dtype, shape, seed + k)
        # alternate nesting so the tree has lists and tuples, not only a flat dict
        tree[f"l{k}"] = [leaf] if k % 3 == 1 else ((leaf, None) if k % 3 == 2 else leaf)
    kw = dict(bucket_bytes=bucket_bytes, pack_threshold=pack_threshold, per_leaf=per_leaf)
    plan, back = round_trip(tree, **kw)
    assert_tree_bitexact(back, tree)
    if per_leaf:
        assert all(len(b.leaves) == 1 for b in plan.buckets)
    else:
        _check_bucket_invariants(plan, bucket_bytes, pack_threshold)
    assert jaxsync.make_plan(tree, **kw) == plan


def test_flat_default_buckets_stay_small():
    # flat's default cap is 4 MiB: a ResNet-18-sized tree is several packed
    # buffers (16 MiB ones cost 4x more on 8 CPU devices), and a leaf above the
    # cap travels alone (never split, never copied into a bucket)
    MiB = 2**20
    from jaxsync._core._config import make_config

    cfg = make_config("flat_mean", "flat", "i", None)  # what flat_mean(...) validates
    assert cfg.bucket_bytes == 4 * MiB and cfg.pack_threshold is None
    tree = {
        "big": jax.ShapeDtypeStruct((5 * MiB // 4,), jnp.float32),
        **{f"w{i}": jax.ShapeDtypeStruct((MiB // 4,), jnp.float32) for i in range(6)},
    }
    plan = jaxsync.make_plan(tree, bucket_bytes=cfg.bucket_bytes, pack_threshold=None)
    sizes = sorted(b.size * 4 for b in plan.buckets)
    assert sizes == [2 * MiB, 4 * MiB, 5 * MiB], sizes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 9])
def test_packing_is_a_plain_concatenation(parts, dtype):
    from jaxsync._core._plan import concat

    xs = [jnp.arange(i, i + 2 + i, dtype=dtype) for i in range(parts)]
    got = np.asarray(concat(xs).astype(jnp.float32))
    want = np.concatenate([np.asarray(x.astype(jnp.float32)) for x in xs])
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert concat(xs).dtype == jnp.dtype(dtype)


def test_packing_many_float32_parts_copies_them_unfused():
    # XLA:CPU fuses a 1-D concatenation of up to 8 operands with the operands'
    # producers into one loop that looks up each element's operand (42 -> 28 ms
    # for flat on the ResNet-like bench tree when avoided): a bucket of more than
    # three float32 parts is concatenated on its own, as a copy.
    if jax.default_backend() != "cpu":
        pytest.skip("the row form is used on CPU only")
    tree = {
        f"l{i}": jax.ShapeDtypeStruct((3, 3, 8, 8) if i % 2 else (64,), jnp.float32)
        for i in range(6)
    }
    plan = jaxsync.make_plan(tree, bucket_bytes=2**20, pack_threshold=None)
    assert len(plan.buckets) == 1
    step = jax.jit(lambda t: plan.pack(jax.tree.map(lambda x: x * 2.0 + 1.0, t)))
    entry = step.lower(tree).compile().as_text().split("\nENTRY ", 1)[1]
    assert re.search(r"\bconcatenate\(", entry), entry
