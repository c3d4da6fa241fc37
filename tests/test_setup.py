"""Set-up (scripts/setup.sh) and the CUDA toolkit choice (jaxsync/_cli/_toolkit.py).

The from-scratch test is slow (a new virtual environment with no pip cache, mpi4jax
built from source, then the demo): marked ``slow``, and run by CI like every test.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxsync._cli import _toolkit

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"


def _toolkit_at(root: Path) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    (root / "bin").mkdir()
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    return root


def _no_glob(pattern):
    del pattern
    return []


# ---------------------------------------------------------------- CUDA root choice


def test_cuda_root_from_the_usual_link_not_nvcc_parent(tmp_path):
    # The layout: <prefix>/cuda-13.0 holds the headers, <prefix>/cuda links to
    # it, and nvcc is a wrapper in <prefix>/bin next to an unrelated <prefix>/include.
    prefix = tmp_path / "usr_local"
    real = _toolkit_at(prefix / "cuda-13.0")
    (prefix / "cuda").symlink_to(real)
    (prefix / "include").mkdir()
    nvcc = prefix / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    got = _toolkit.find_cuda_root(
        env={}, nvcc=str(nvcc), glob_fn=_no_glob, usual_link=str(prefix / "cuda")
    )
    assert Path(got).resolve() == real.resolve()
    assert not _toolkit.has_headers(str(prefix))  # what mpi4jax would have guessed


def test_cuda_root_follows_an_nvcc_wrapper_script(tmp_path):
    real = _toolkit_at(tmp_path / "opt" / "cuda-12.4")
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    got = _toolkit.find_cuda_root(
        env={}, nvcc=str(wrapper), glob_fn=_no_glob, usual_link=str(tmp_path / "missing")
    )
    assert got == str(real)


def test_cuda_root_follows_an_nvcc_symlink(tmp_path):
    real = _toolkit_at(tmp_path / "cuda-12.2")
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(real / "bin" / "nvcc")
    got = _toolkit.find_cuda_root(
        env={}, nvcc=str(link), glob_fn=_no_glob, usual_link=str(tmp_path / "missing")
    )
    assert got == str(real)


def test_cuda_home_wins_over_everything(tmp_path):
    a = _toolkit_at(tmp_path / "cuda-12.1")
    b = _toolkit_at(tmp_path / "cuda-12.8")
    got = _toolkit.find_cuda_root(
        env={"CUDA_HOME": str(a), "CUDA_PATH": str(b)},
        nvcc=None,
        glob_fn=_no_glob,
        usual_link=str(b),
    )
    assert got == str(a)


def test_several_toolkits_newest_first(tmp_path):
    for v in ("11.8", "12.10", "12.4"):
        _toolkit_at(tmp_path / f"cuda-{v}")
    got = _toolkit.find_cuda_root(
        env={},
        nvcc=None,
        glob_fn=lambda p: [str(x) for x in tmp_path.glob("cuda-*")],
        usual_link=str(tmp_path / "cuda"),
    )
    assert got == str(tmp_path / "cuda-12.10")


def test_variable_without_headers_is_an_error(tmp_path):
    _toolkit_at(tmp_path / "cuda")
    with pytest.raises(
        _toolkit.ToolkitNotFound, match=r"CUDA_PATH=.*has no include/cuda_runtime.h.*Fix"
    ):
        _toolkit.find_cuda_root(
            env={"CUDA_PATH": str(tmp_path)},
            nvcc=None,
            glob_fn=_no_glob,
            usual_link=str(tmp_path / "cuda"),
        )


def test_no_toolkit_names_every_folder_tried(tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    (tmp_path / "include").mkdir()
    with pytest.raises(_toolkit.ToolkitNotFound) as e:
        _toolkit.find_cuda_root(
            env={}, nvcc=str(nvcc), glob_fn=_no_glob, usual_link=str(tmp_path / "cuda")
        )
    msg = str(e.value)
    assert str(tmp_path / "cuda") in msg and str(tmp_path) + "  (the toolkit of" in msg
    assert "CUDA_HOME" in msg and "unset JAXSYNC_CUDA" in msg


def test_toolkit_script_runs_without_jaxsync_installed(tmp_path):
    # setup.sh runs the file before jaxsync is installed: standard library only.
    r = subprocess.run(
        [sys.executable, "-S", "-I", str(ROOT / "jaxsync" / "_cli" / "_toolkit.py"), "cuda-root"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path)},
    )
    assert r.returncode == 1
    assert "has no include/cuda_runtime.h" in r.stderr


# ---------------------------------------------------------------- setup.sh


def _setup_env(venv: Path, **extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAXSYNC_", "VIRTUAL_ENV", "XLA_FLAGS"))
    }
    env.update(JAXSYNC_VENV=str(venv), PIP_NO_CACHE_DIR="1", **extra)
    return env


def test_failed_step_stops_setup_names_it_and_writes_no_stamp(tmp_path):
    venv = tmp_path / "venv"
    r = subprocess.run(
        ["bash", str(SETUP)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_setup_env(
            venv, JAXSYNC_SETUP_EXTRA_PACKAGES="jaxsync-no-such-package-for-tests==0.0.1"
        ),
    )
    assert r.returncode != 0
    assert "[setup] FAILED: install JAXSYNC_SETUP_EXTRA_PACKAGES" in r.stderr
    assert "No matching distribution found for jaxsync-no-such-package" in r.stderr
    assert f"full log: {venv}/setup.log" in r.stderr
    assert not (venv / ".jaxsync-setup").exists()
    # No later step ran.
    assert "install jax" not in r.stdout
    assert "No matching distribution" in (venv / "setup.log").read_text()


def test_bad_cuda_choice_is_refused(tmp_path):
    r = subprocess.run(
        ["bash", str(SETUP)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_setup_env(tmp_path / "venv", JAXSYNC_CUDA="yes"),
    )
    assert r.returncode == 2
    assert "JAXSYNC_CUDA must be 12, 13 or unset" in r.stderr


@pytest.mark.slow
def test_fresh_setup_with_a_headerless_nvcc_first_on_path_then_demo(tmp_path):
    """The issue's machine: nvcc first on PATH in a folder whose include/ has no CUDA
    headers. Set-up must build the CPU bridge, verify, and the demo run. pip's cache
    of downloads is used (set-up builds mpi4jax with --no-cache-dir whatever the
    environment says, which is what a cache could have hidden); the download of every
    wheel is the CI run's own set-up, in a fresh clone."""
    fake = tmp_path / "fakecuda"
    (fake / "bin").mkdir(parents=True)
    (fake / "include").mkdir()
    (fake / "lib").mkdir()
    (fake / "bin" / "nvcc").write_text("#!/bin/sh\necho 'nvcc: fake, no headers'\n")
    (fake / "bin" / "nvcc").chmod(0o755)
    venv = tmp_path / "venv"
    env = _setup_env(venv, PATH=f"{fake / 'bin'}:{os.environ['PATH']}")
    env.pop("PIP_NO_CACHE_DIR")
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "build mpi4jax from source (CPU bridge only" in r.stdout
    assert "[setup] ok:" in r.stdout and "bridges: cpu)" in r.stdout
    assert (venv / ".jaxsync-setup").exists()
    # A second run is a no-op.
    r2 = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=120, env=env)
    assert r2.returncode == 0 and r2.stdout == "", r2.stdout + r2.stderr
    demo = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "demo OK" in demo.stdout
    shutil.rmtree(venv, ignore_errors=True)


# ---------------------------------------------------------------- the docs check


def test_the_docs_build_of_the_test_script_fails_on_a_warning(tmp_path):
    """scripts/test.sh builds the site with mkdocs' own flags; with ``--quiet``
    beside ``--strict`` mkdocs 1.6 counted no warning and passed a broken link."""
    line = next(
        x for x in (ROOT / "scripts" / "test.sh").read_text().splitlines() if '/mkdocs" build' in x
    )
    flags = [f for f in line.split() if f.startswith("-") and f != "--site-dir"]
    assert "--strict" in flags, line
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Page\n\n[missing](missing.md)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: check\n")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    cmd = [mkdocs, "build", *flags, "--site-dir", tmp_path / "site", "-f", tmp_path / "mkdocs.yml"]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0, f"{line}\n{r.stdout}{r.stderr}"
    assert "missing.md" in r.stdout + r.stderr


def test_verify_install_imports_every_extra_the_suite_needs():
    """Set-up's final check imports every package of the test, bench, demo and docs
    extras (it left out flax, equinox and orbax, so a set-up without them passed
    its check and failed in the suite)."""
    import ast
    import importlib.metadata
    import re

    # the installed metadata (pyproject.toml's extras, as pip saw them)
    reqs = importlib.metadata.requires("jaxsync") or []
    # distribution name -> the module verify_install imports for it
    module = {
        "scikit-learn": "sklearn",
        "mkdocs-material": "material",
        "mkdocstrings": "mkdocstrings_handlers.python",
        "mkdocstrings-python": "mkdocstrings_handlers.python",
        "griffelib": "griffe",
        "mkdocs-jupyter": "mkdocs_jupyter",
        "orbax-checkpoint": "orbax.checkpoint",
        "pytest-xdist": "xdist",
    }
    wanted = set()
    for req in reqs:
        extra = re.search(r'extra == "(\w+)"', req)
        if extra and extra.group(1) in ("mpi", "test", "bench", "demo", "docs"):
            dist = re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0]
            wanted.add(module.get(dist, dist.replace("-", "_")))
    assert {"flax", "mpi4py", "mkdocs"} <= wanted, reqs  # the metadata was read
    wanted.discard("mpich")  # a wheel of binaries: verify_install checks mpirun
    tree = ast.parse((ROOT / "scripts" / "verify_install.py").read_text())
    imported = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert wanted - imported == set(), "verify_install.py does not import these"
