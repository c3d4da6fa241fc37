"""Local updates for slow links (``jaxsync.diloco``, ``local_sgd``, ``bmuf``):
islands that synchronise every step, and exchange parameters every ``H`` steps.

Modules: ``_islands`` (``islands``, ``Islands``, the inner-mean guard),
``_state`` (the state, the static checks), ``_update`` (one step), ``_diloco``
(``diloco``, streaming), ``_inflight`` (streaming's mean in flight across
steps), ``_resume`` (a checkpoint with a mean in flight), ``_regroup``
(another island count), ``_presets``
(``local_sgd``, ``bmuf``).
"""

from ._diloco import diloco
from ._islands import Islands, islands
from ._presets import BMUFState, bmuf, local_sgd
from ._regroup import regroup
from ._resume import in_flight, resume_in_flight
from ._state import LocalUpdatesState

__all__ = [
    "BMUFState",
    "Islands",
    "LocalUpdatesState",
    "bmuf",
    "diloco",
    "in_flight",
    "islands",
    "local_sgd",
    "regroup",
    "resume_in_flight",
]
