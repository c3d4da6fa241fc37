"""The command line (python -m jaxsync ...) and the quickstart example."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = str(Path(sys.executable).with_name("mpirun"))


def run(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("MALLOC_")}
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def test_help_lists_commands():
    r = run(sys.executable, "-m", "jaxsync", "--help")
    assert r.returncode == 0, r.stderr
    for command in ("demo", "bench", "info"):
        assert command in r.stdout


def test_no_command_is_an_error():
    r = run(sys.executable, "-m", "jaxsync")
    assert r.returncode == 2


def test_info_json_single_process():
    r = run(sys.executable, "-m", "jaxsync", "info", "--json", "--devices", "3")
    assert r.returncode == 0, r.stderr
    (info,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert info["topology"]["size"] == 1
    assert info["topology"]["local_devices"] == 3
    assert info["mpi_backend"].startswith("ok"), info["mpi_backend"]
    assert info["native_mpi"]["loaded"], info["native_mpi"]


def test_info_under_mpirun_lists_every_rank():
    r = run(MPIRUN, "-n", "2", sys.executable, "-m", "jaxsync", "info", "--json", "--devices", "2")
    assert r.returncode == 0, r.stderr
    infos = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert sorted(i["topology"]["rank"] for i in infos) == [0, 1]
    assert all(i["topology"]["size"] == 2 and i["mpi_thread_level"] == "multiple" for i in infos)


def test_demo_trains_and_matches_single_process():
    r = run(sys.executable, "-m", "jaxsync", "demo", "--steps", "25")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The table's row label is printed either way: assert the values.
    (verdict,) = [ln for ln in r.stdout.splitlines() if ln.startswith("demo ")]
    assert verdict.startswith("demo OK:"), verdict
    assert verdict.rstrip().endswith("replicas bit-identical."), verdict
    row = next(ln for ln in r.stdout.splitlines() if "replicas bit-identical (all" in ln)
    assert "yes" in row.split("processes)")[-1] and "NO" not in row, row


@pytest.mark.parametrize("args", [["--batch", "7"], ["--devices", "0"]])
def test_demo_rejects_bad_arguments(args):
    r = run(sys.executable, "-m", "jaxsync", "demo", *args)
    assert r.returncode == 2
    assert "must be" in r.stderr


def test_quickstart_example_converges():
    r = run(sys.executable, str(ROOT / "examples" / "quickstart.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    loss = float(r.stdout.split("loss ")[1].split(",")[0])
    assert loss < 1e-4


def test_tune_host_allocator_in_a_fresh_process():
    """It changes the process-wide allocator: checked in a child, not in pytest."""
    code = (
        "import jaxsync; s = jaxsync.host_allocator_state(); "
        "print(s, jaxsync.tune_host_allocator(), jaxsync.host_allocator_state())"
    )
    r = run(sys.executable, "-c", code)
    assert r.returncode == 0, r.stderr
    glibc = platform.libc_ver()[0] == "glibc"
    want = "default True tuned" if glibc else "default False default"
    assert r.stdout.strip() == want, (r.stdout, platform.libc_ver())


_FAULTS = """
import resource, sys, threading
import numpy as np
import jaxsync
print(jaxsync.tune_host_allocator(map_large=sys.argv[1] == "map"))
def faults_per_allocation(out, n=6):
    held = np.ones(5 << 20)  # 40 MiB held, so the next 40 MiB needs room of its own
    np.ones(5 << 20).sum()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        np.ones(5 << 20).sum()
    out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n)
    del held
out = []
faults_per_allocation(out)
t = threading.Thread(target=faults_per_allocation, args=(out,))  # another malloc arena
t.start(); t.join()
print(*out)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_tune_host_allocator_reuses_buffers_above_the_mmap_ceiling():
    """Buffers over glibc's 32 MiB mmap ceiling (a step's temporaries with several
    fake devices) are reused, not mapped and faulted in afresh on every allocation
    (as they were when only the mmap threshold was raised: 532 faults per 40 MiB
    allocation here in the main thread, 21 to 532 in another, 0 now)."""
    r = run(sys.executable, "-c", _FAULTS, "keep")
    assert r.returncode == 0, r.stderr
    ok, faults = r.stdout.splitlines()
    assert ok == "True"
    assert all(float(f) < 4 for f in faults.split()), faults  # of 10,240 pages
    # the check can fail: with mapping left on, every allocation faults in pages
    r = run(sys.executable, "-c", _FAULTS, "map")
    assert r.returncode == 0, r.stderr
    assert all(float(f) > 16 for f in r.stdout.splitlines()[1].split()), r.stdout


def test_tune_host_allocator_rejects_a_non_bool_map_large():
    import jaxsync

    with pytest.raises(ValueError, match="map_large must be True or False, got 'yes'"):
        jaxsync.tune_host_allocator(map_large="yes")  # type: ignore[arg-type]


def test_bench_help_lists_every_suite():
    from jaxsync.bench import cli

    out = subprocess.run(
        [sys.executable, "-m", "jaxsync", "bench", "--help"], capture_output=True, text=True
    ).stdout
    assert set(cli.SUITE_HELP) == set(cli.SUITES)
    for name, text in cli.SUITE_HELP.items():
        assert f"  {name:<9} {text[:40]}" in out, out
