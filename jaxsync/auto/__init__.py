"""Choosing a strategy: the cost model, ``python -m jaxsync tune`` and ``auto_mean``.

``_cost`` (a link's alpha/beta/gamma and the profile), ``_cost_ops`` (each
strategy's operations on a topology), ``_cost_fit`` (fitting a profile to
timings), ``_choose`` (the deterministic choice), ``_auto`` (``auto_mean`` and
``strategy="auto"``), ``_tune``/``_tune_sync``/``_rounds`` (the calibration) and
``_project`` (predictions on paper, ``tune --project``). ``auto_mean`` is also
``jaxsync.auto_mean``.

``strategy="auto"`` plugs into the core's factories and sync here.
"""

from jaxsync._core import _plugins

from ._auto import AUTO, auto_mean, make_auto_config, resolve
from ._project_trees import save_tree_spec

_plugins.register_strategy(AUTO, _plugins.Strategy(make_auto_config, resolve))

__all__ = ["auto_mean", "save_tree_spec"]
