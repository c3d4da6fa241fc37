"""Smoke test of ``python -m jaxsync bench --suite quant-quality`` (one process, the
digits MLP, tiny sizes): it runs through the ``--suite`` dispatch and writes its
record; int8 through the quantized wire really changes the run (its parameters
are not float32's bit for bit, and its eval loss differs) yet ends close to
float32's (a loose 5 % bound at 40 steps); the targets follow the spread."""

import json

import jax

from jaxsync.bench import cli


def test_the_quant_quality_suite_quantizes_and_stays_close(tmp_path):
    argv = ["--suite", "quant-quality", "--tasks", "digits", "--formats", "float32,int8"]
    argv += ["--seeds", "2", "--steps", "40", "--replicas", "2", "--out", str(tmp_path)]
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
        assert cli.main(argv) == 0
    got = json.loads((tmp_path / "quant-quality.json").read_text())
    task = got["tasks"]["digits"]
    rows = task["formats"]
    assert set(rows) == {"float32", "int8"} and task["steps"] == 40
    f32, i8 = rows["float32"], rows["int8"]
    assert len(f32["loss"]) == len(i8["loss"]) == 2
    assert task["spread"] == max(f32["loss"]) - min(f32["loss"])
    assert f32["differs"] == [False, False]
    assert i8["differs"] == [True, True]
    for a, b in zip(i8["loss"], f32["loss"]):
        assert a != b and abs(a / b - 1) < 0.05
    assert i8["target"] == task["spread"] and i8["met"] == (i8["gap"] <= task["spread"])
