"""Profiles for ``strategy="auto"``: where one is found, reading it (with the
fall-back to the built-in default and its warnings), and the once-per-process
warning when there is none.

Imports: the standard library and ``_cost``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from . import _cost
from ._cost import Profile

PROFILE_ENV = "JAXSYNC_PROFILE"
DEFAULT_PROFILE_PATH = Path("~/.cache/jaxsync/profile.json")


def default_profile_path() -> Path:
    """``$JAXSYNC_PROFILE``, else ``~/.cache/jaxsync/profile.json``."""
    env = os.environ.get(PROFILE_ENV)
    return Path(env).expanduser() if env else DEFAULT_PROFILE_PATH.expanduser()


def load_profile(profile=None) -> tuple[Profile, str]:
    """The profile to use and a note on where it came from (or why not).

    ``profile``: ``None`` (``$JAXSYNC_PROFILE`` or the default path, else the
    built-in default), a path, a dict (a profile's JSON) or a
    :class:`jaxsync.auto._cost.Profile`. A missing file given by ``profile`` or
    ``$JAXSYNC_PROFILE``, an unreadable one, or parameters that are unusable
    (negative or non-finite times, malformed overheads: checked here, when the
    profile is read) fall back to the built-in default with a warning. Nothing
    asked for and no file at the default path: the built-in default, without a
    warning here (``auto_mean`` and ``strategy="auto"`` warn once per process;
    ``info --tree`` prints the note).
    """
    if isinstance(profile, (Profile, dict)):
        where = "from a dict" if isinstance(profile, dict) else profile.source
        try:
            prof = profile if isinstance(profile, Profile) else Profile.from_json(profile, "<dict>")
            bad = prof.problems()
            if bad:
                raise ValueError(f"{where}: {'; '.join(bad)}")
        except (ValueError, KeyError, TypeError) as e:
            note = f"profile {where} unreadable ({e}): using the built-in default"
            warnings.warn(f"jaxsync auto: {note}", stacklevel=3)
            return _cost.DEFAULT_PROFILE, note
        return prof, f"profile {where}"
    explicit = profile is not None
    path = Path(profile).expanduser() if explicit else default_profile_path()
    if not path.exists():
        note = (
            f"no profile at {path} (write one with `python -m jaxsync tune --out "
            f"{path}`): using the built-in default link parameters"
        )
        if explicit or os.environ.get(PROFILE_ENV):
            warnings.warn(f"jaxsync auto: {note}", stacklevel=3)
        return _cost.DEFAULT_PROFILE, note
    try:
        data = json.loads(path.read_text())
        return Profile.from_json(data, str(path)), f"profile {path}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        note = f"profile {path} unreadable ({e}): using the built-in default"
        warnings.warn(f"jaxsync auto: {note}", stacklevel=3)
        return _cost.DEFAULT_PROFILE, note


_no_profile_warned = False  # the warning below, once per process


def _warn_no_profile_once(fn: str) -> None:
    """Warn (once per process) that the cost model runs on the built-in default."""
    global _no_profile_warned
    if _no_profile_warned:
        return
    _no_profile_warned = True
    path = default_profile_path()
    warnings.warn(
        f"jaxsync auto: {fn} got no profile and there is none at {path}: strategy "
        "'auto' chooses from the built-in default link parameters, not this "
        f"machine's measured ones. Fix: run `python -m jaxsync tune --out {path}` "
        "once per configuration (processes x devices) and it is found there, or "
        "pass profile='profile.json' (written by `python -m jaxsync tune --out "
        "profile.json`). This warning is shown once per process.",
        UserWarning,
        stacklevel=4,
    )
