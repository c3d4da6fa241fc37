"""Compressed synchronisation: fewer bytes on the wire, with error feedback.

``powersgd_mean`` (low-rank, PowerSGD) and ``sign_mean`` (1-bit signs with a
scale, as signSGD / EF-SignSGD) keep each replica's residual in their state
(``PowerSGDState``, ``SignState``); ``state_specs`` says how to split that state
under ``shard_map``. Every name here is also ``jaxsync.NAME``.
"""

from ._common import PowerSGDState, SignState, state_specs
from ._powersgd import powersgd_mean
from ._sign import sign_mean

__all__ = ["PowerSGDState", "SignState", "powersgd_mean", "sign_mean", "state_specs"]
