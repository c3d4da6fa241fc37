"""``jaxsync.SyncOptions``: one text and one check per shared option; ``options=`` on
every factory, keywords as overrides (issue 52, item 1)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxsync
from jaxsync._core._options import DEFAULTS, FIELDS

ROOT = Path(__file__).resolve().parents[1]

FAMILY = [
    "naive_mean",
    "flat_mean",
    "hierarchical_mean",
    "two_dimensional_mean",
    "single_node_mean",
    "auto_mean",
]
TREE = {"a": jnp.arange(6.0).reshape(3, 2), "b": jnp.arange(3, dtype=jnp.bfloat16)}


def _factory(name):
    fac = getattr(jaxsync, name)
    if name == "single_node_mean":
        return lambda **kw: fac("i", **kw)
    if name == "auto_mean":
        return lambda **kw: fac("i", comm=None, profile={}, **kw)
    return lambda **kw: fac("i", comm=None, **kw)


def _program(tx) -> str:
    step = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")
    return str(jax.make_jaxpr(step)(jax.tree.map(lambda x: jnp.stack([x] * 4), TREE)))


def _shared(name) -> list[str]:
    return [p for p in inspect.signature(getattr(jaxsync, name)).parameters if p in FIELDS]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", FAMILY)
def test_options_give_the_program_the_keywords_give(name):
    make = _factory(name)
    given = dict(reduce="sum", comm_dtype=jnp.bfloat16, check_finite=True, bucket_bytes=64)
    if name == "auto_mean":
        del given["comm_dtype"]  # auto_mean: a lossy wire only with allow_lossy
    by_keyword = _program(make(**given))
    by_options = _program(make(options=jaxsync.SyncOptions(**given)))
    assert by_options == by_keyword
    assert by_options != _program(make()), "the options changed nothing: a vacuous test"
    # a keyword overrides a default-valued option; options and keywords together
    half = dict(list(given.items())[:2])
    rest = {k: v for k, v in given.items() if k not in half}
    assert _program(make(options=jaxsync.SyncOptions(**half), **rest)) == by_keyword


def test_sync_gradients_and_sharded_take_options():
    opts = jaxsync.SyncOptions(reduce="sum")
    f = lambda **kw: jax.vmap(
        lambda t: jaxsync.sync_gradients(t, axis_name="i", comm=None, **kw), axis_name="i"
    )({"w": jnp.arange(4.0)})["w"]
    assert (f(options=opts) == f(reduce="sum")).all() and float(f(options=opts)[0]) == 6.0
    inner = optax.sgd(1.0)
    a = jaxsync.sharded(inner, axis_name="i", comm=None, options=opts)
    b = jaxsync.sharded(inner, axis_name="i", comm=None, reduce="sum")
    assert _program(a).replace("sum", "") == _program(b).replace("sum", "")
    with pytest.raises(ValueError, match=r"sharded takes no option 'overlap'"):
        jaxsync.sharded(inner, axis_name="i", comm=None, options=jaxsync.SyncOptions(overlap=True))


def test_a_keyword_overrides_options_even_with_the_default_value():
    opts = jaxsync.SyncOptions(reduce="sum", comm_dtype=jnp.bfloat16)
    back = jaxsync.flat_mean("i", comm=None, options=opts, reduce="mean")
    assert _program(back) == _program(jaxsync.flat_mean("i", comm=None, comm_dtype=jnp.bfloat16))
    assert _program(back) != _program(jaxsync.flat_mean("i", comm=None, options=opts))


def test_an_option_the_factory_does_not_take_is_refused():
    with pytest.raises(ValueError, match=r"single_node_mean takes no option 'staging', but "):
        jaxsync.single_node_mean("i", options=jaxsync.SyncOptions(staging="host"))
    with pytest.raises(ValueError, match=r"naive_mean takes no option 'host_tier'.*Fix:"):
        jaxsync.naive_mean("i", comm=None, options=jaxsync.SyncOptions(host_tier=True))
    with pytest.raises(TypeError, match=r"'options'; expected: a jaxsync.SyncOptions"):
        jaxsync.flat_mean("i", comm=None, options={"reduce": "sum"})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"single_node_mean\(\) got an unexpected keyword argument 'staging': it takes "
        r"no option 'staging' \(it takes reduce, bucket_bytes",
    ):
        jaxsync.single_node_mean("i", staging="host")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bucket_size': it takes"):
        jaxsync.flat_mean("i", comm=None, bucket_size=4)


def test_type_checkers_see_the_keywords(tmp_path):
    """The keywords are typed (``Unpack`` of a TypedDict): mypy rejects a wrong one."""
    mypy_api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "use.py"
    snippet.write_text(
        "import jax.numpy as jnp\n"
        "import jaxsync\n"
        "jaxsync.hierarchical_mean('i', comm=None, reduce='sum', comm_dtype=jnp.bfloat16)\n"
        "jaxsync.hierarchical_mean('i', comm=None, reduce='max')\n"
        "jaxsync.single_node_mean('i', staging='host')\n"
        "jaxsync.flat_mean('i', comm=None, bucket_size=3)\n"
        "jaxsync.mean('two_dimensional', 'i', comm=None, overlap=True)\n"
        "jaxsync.mean('flat', 'i', reduce='max')\n"
        "jaxsync.mean('ring', 'i')\n"
        "jaxsync.two_dimensional_mean('i', None, double_buffering='yes')\n"
        "jaxsync.naive_mean(axis_name='i', comm=None, overlap=False)\n"
    )
    cache = ROOT / ".venv" / ".mypy_cache"
    out, err, status = mypy_api.run(
        [str(snippet), "--ignore-missing-imports", "--cache-dir", str(cache), "--no-error-summary"]
    )
    lines = sorted({int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line})
    assert lines == [4, 5, 6, 8, 9, 10], out + err


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (dict(reduce="max"), r"reduce must be one of \('mean', 'sum'\), got 'max'\. Fix:"),
        (dict(bucket_bytes=-1), r"bucket_bytes"),
        (dict(comm_dtype=jnp.int8), r"comm_dtype must be one of"),
        (dict(predivide=0.5), r"predivide must be a finite float >= 1"),
        (dict(on_timeout="abort"), r"on_timeout='abort' needs a timeout"),
        (dict(overlap="yes"), r"overlap"),
        (dict(host_tier="x"), r"host_tier"),
        (dict(weights="some"), r"weights must be one of"),
        (dict(early_termination="raise"), r"early_termination='raise' reads"),
    ],
)
def test_values_are_checked_when_made_as_a_factory_checks_them(bad, pattern):
    with pytest.raises((TypeError, ValueError), match=pattern) as made:
        jaxsync.SyncOptions(**bad)
    with pytest.raises((TypeError, ValueError), match=pattern) as called:
        jaxsync.hierarchical_mean("i", comm=None, **bad)
    # the same check, named for who was called
    assert str(made.value).replace("jaxsync.SyncOptions", "hierarchical_mean") == str(called.value)


def test_replace_checks_and_names_unknown_options():
    opts = jaxsync.SyncOptions(reduce="sum")
    assert opts.replace(reduce="mean") == jaxsync.SyncOptions()
    with pytest.raises(TypeError, match=r"no option 'reduction'.*Fix: check the spelling"):
        opts.replace(reduction="mean")
    with pytest.raises(ValueError, match=r"reduce must be one of"):
        opts.replace(reduce="max")


@pytest.mark.parametrize(
    "name", [*FAMILY, "mean", "sync_gradients", "sharded", "powersgd_mean", "sign_mean"]
)
def test_the_keywords_are_the_options_with_their_defaults(name):
    params = inspect.signature(getattr(jaxsync, name)).parameters
    assert "options" in params and params["options"].default is None
    assert tuple(getattr(jaxsync, name).takes) == tuple(_shared(name))
    shared = _shared(name)
    assert {"reduce", "check_finite", "staging"} & set(shared), name
    for p in shared:
        assert params[p].default == DEFAULTS[p], (name, p)


def test_each_option_has_one_text():
    """The text of each option is SyncOptions'; the family's docstrings point to it."""
    doc = jaxsync.SyncOptions.__doc__ or ""
    for name in FIELDS:
        assert len(re.findall(rf"^      {name}: ", doc, re.M)) == 1, name
    for fac in [*FAMILY, "sync_gradients"]:
        fdoc = getattr(jaxsync, fac).__doc__ or ""
        own = [n for n in FIELDS if re.search(rf"^      {n}: ", fdoc, re.M)]
        assert not own, f"{fac} documents {own} again: its text is SyncOptions'"
        # it points to that text (directly, or through mean's)
        assert "jaxsync.SyncOptions" in fdoc or "jaxsync.mean" in fdoc, fac
    assert "jaxsync.SyncOptions" in (jaxsync.mean.__doc__ or "")


PRESETS = ["naive", "flat", "hierarchical", "two_dimensional"]


@pytest.mark.parametrize("strategy", PRESETS)
def test_each_preset_is_mean_with_its_strategy(strategy):
    """``flat_mean(...)`` is ``mean("flat", ...)``: the same program, signature and
    refusals; only ``strategy`` is given."""
    preset = getattr(jaxsync, f"{strategy}_mean")
    given = dict(reduce="sum", comm_dtype=jnp.bfloat16, check_finite=True, bucket_bytes=64)
    by_mean = _program(jaxsync.mean(strategy, "i", comm=None, **given))
    assert _program(preset("i", None, options=jaxsync.SyncOptions(**given))) == by_mean
    assert by_mean != _program(jaxsync.mean(strategy, "i", comm=None)), "vacuous"
    assert preset.__name__ == f"{strategy}_mean" and ">>> " in (preset.__doc__ or "")
    mean_params = dict(inspect.signature(jaxsync.mean).parameters)
    del mean_params["strategy"]
    params = inspect.signature(preset).parameters
    assert [p for p in mean_params if p not in params] == (
        ["host_tier"] if strategy == "naive" else []
    )
    assert all(params[p] == mean_params[p] for p in params)
    assert inspect.signature(preset).return_annotation == "optax.GradientTransformation"


def test_mean_refuses_an_unknown_strategy_and_what_the_strategy_does_not_take():
    with pytest.raises(
        ValueError,
        match=r"mean: unexpected strategy; expected one of 'naive', 'flat', "
        r"'hierarchical', 'two_dimensional'; given: 'ring'\. Fix: ",
    ):
        jaxsync.mean("ring", "i")
    with pytest.raises(ValueError, match=r"given: 'single_node'.*single_node_mean"):
        jaxsync.mean("single_node", "i")
    # naive takes no host tier, by either name; its errors name the strategy's factory
    for make in (
        lambda **kw: jaxsync.mean("naive", "i", **kw),
        lambda **kw: jaxsync.naive_mean("i", **kw),
    ):
        with pytest.raises(
            TypeError,
            match=r"naive_mean\(\) got an unexpected keyword "
            r"argument 'host_tier': it takes no option 'host_tier'",
        ):
            make(host_tier="device")
    with pytest.raises(ValueError, match=r"flat_mean: reduce must be one of"):
        jaxsync.mean("flat", "i", reduce="max")
