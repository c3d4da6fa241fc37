"""Find the CUDA toolkit folder for a CUDA build (set-up only; standard library only).

``scripts/setup.sh`` runs this file as a script *before* jaxsync is installed, so it
imports nothing outside the standard library. By default jaxsync and mpi4jax build
their CPU bridges only; a CUDA build happens only when the user asks for it
(``JAXSYNC_CUDA=12`` or ``13``), and then from the folder that really holds
``include/cuda_runtime.h``.

Why not nvcc's parent folder: clusters often put ``nvcc`` (or a wrapper script that
execs the real one) in ``/usr/local/bin`` or a module's ``bin``, whose parent has no
CUDA headers. mpi4jax's own build guesses the root that way and stops on
``cuda_runtime.h: No such file``.

Usage as a script::

    python jaxsync/_cli/_toolkit.py cuda-root   # prints the root, or explains and exits 1
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence

HEADER = os.path.join("include", "cuda_runtime.h")
ENV_VARS = ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")
USUAL_LINK = "/usr/local/cuda"


class ToolkitNotFound(RuntimeError):
    """No candidate folder holds ``include/cuda_runtime.h``."""


def has_headers(root: str) -> bool:
    return os.path.isfile(os.path.join(root, HEADER))


def _version_key(path: str):
    nums = re.findall(r"\d+", os.path.basename(path))
    return tuple(int(n) for n in nums)


def _nvcc_targets(nvcc: str) -> list[str]:
    """Folders that an ``nvcc`` on PATH may belong to, best first.

    The resolved file's grandparent (``<root>/bin/nvcc``), and, when ``nvcc`` is a
    small wrapper script (``exec /opt/cuda-12.4/bin/nvcc "$@"``), the grandparent of
    the path it execs.
    """
    out = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    try:
        if os.path.getsize(nvcc) < 4096:
            with open(nvcc, "rb") as f:
                text = f.read().decode("utf-8", "replace")
            for m in re.finditer(r"(/[^\s\"']+)/bin/nvcc\b", text):
                out.append(os.path.realpath(m.group(1)))
    except OSError:
        pass
    return out


def candidates(
    env: Mapping[str, str],
    nvcc: str | None,
    glob_fn: Callable[[str], Sequence[str]] = glob.glob,
    usual_link: str = USUAL_LINK,
) -> list[tuple[str, str]]:
    """Candidate toolkit roots as ``(folder, why)``, in the order they are tried."""
    out: list[tuple[str, str]] = []
    for var in ENV_VARS:
        if env.get(var):
            out.append((env[var], f"${var}"))
    out.append((usual_link, "the usual toolkit link"))
    for path in sorted(glob_fn(usual_link + "-*"), key=_version_key, reverse=True):
        out.append((path, "an installed toolkit (newest first)"))
    if nvcc:
        for path in _nvcc_targets(nvcc):
            out.append((path, f"the toolkit of {nvcc}"))
    seen: set[str] = set()
    unique = []
    for path, why in out:
        key = os.path.normpath(path)
        if key not in seen:
            seen.add(key)
            unique.append((key, why))
    return unique


def find_cuda_root(
    env: Mapping[str, str] | None = None,
    nvcc: str | None = None,
    glob_fn: Callable[[str], Sequence[str]] = glob.glob,
    usual_link: str = USUAL_LINK,
) -> str:
    """Return the CUDA toolkit folder that holds ``include/cuda_runtime.h``.

    Tried in order: ``$CUDA_HOME``, ``$CUDA_PATH``, ``$CUDA_ROOT``, ``/usr/local/cuda``,
    ``/usr/local/cuda-*`` (newest first), then the toolkit that ``nvcc`` on ``PATH``
    really lives in (following links and one-line wrapper scripts). A folder named by
    a variable that lacks the headers is an error, not skipped: the user asked for it.

    Raises:
      ToolkitNotFound: naming every folder tried and what to set.
    """
    env = os.environ if env is None else env
    if nvcc is None:
        nvcc = shutil.which("nvcc", path=env.get("PATH"))
    tried = []
    for path, why in candidates(env, nvcc, glob_fn, usual_link):
        if has_headers(path):
            return path
        tried.append(f"  {path}  ({why})")
        if why.startswith("$"):
            raise ToolkitNotFound(
                f"{why[1:]}={path} has no {HEADER}. Fix: point {why[1:]} at the CUDA "
                "toolkit folder that holds include/cuda_runtime.h (e.g. "
                "CUDA_HOME=/usr/local/cuda-12.4), or unset it."
            )
    raise ToolkitNotFound(
        "a CUDA build was asked for (JAXSYNC_CUDA), but no CUDA toolkit folder with "
        f"{HEADER} was found. Tried:\n" + "\n".join(tried) + "\nFix: set CUDA_HOME to "
        "the toolkit folder (the one whose include/ holds cuda_runtime.h, e.g. "
        "CUDA_HOME=/usr/local/cuda-12.4; on a cluster: `module load cuda` then "
        "CUDA_HOME=$CUDA_ROOT), or unset JAXSYNC_CUDA for a CPU-only build."
    )


def main(argv: Sequence[str]) -> int:
    if list(argv) != ["cuda-root"]:
        print("usage: python jaxsync/_cli/_toolkit.py cuda-root", file=sys.stderr)
        return 2
    try:
        print(find_cuda_root())
    except ToolkitNotFound as e:
        print(f"[setup] {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
