"""State that one rank alone holds (``sharded``'s slices): a ring copy at every commit.

A :class:`jaxsync.ShardedState` holds this process's 1/N slices of the optimizer
state; they die with the process. At each commit, rank ``r`` of an ``n``-rank world
sends its slices to rank ``r + 1`` (mod ``n``) and keeps those of rank ``r - 1``:
point-to-point, one extra slice set per rank (the sharded state's memory, twice).
On recovery the survivors pool their own and their left neighbour's slices of the
agreed commit, rebuild the whole state (:func:`jaxsync.gather_state`) and cut it for
the new world (:func:`jaxsync.shard_state`); each survivor then keeps its new slices
and its new left neighbour's, so a second loss before the next commit is covered too.
Two ring neighbours lost together take the first one's slices with them: the restore
raises :class:`SlicesLost`, naming them.

Imports: numpy, jax and ``jaxsync.zero`` (when called).
"""

from __future__ import annotations

from typing import Any

RING_TAG = 7201  # the commit's neighbour copy, on the state's communicator


class SlicesLost(RuntimeError):
    """The survivors do not hold some rank's slices of a sharded entry (two ring
    neighbours lost together): nothing to restore them from."""


def ring_copy(comm: Any, parts: dict) -> dict:
    """Send ``parts`` (name -> this rank's ShardedState) to rank + 1, get rank - 1's.

    Collective over ``comm`` (every rank sends one message and receives one); a
    process failure raises (the commit then does not count on this rank).
    """
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1 or not parts:
        return {}
    return comm.sendrecv(
        parts, dest=(r + 1) % n, sendtag=RING_TAG, source=(r - 1) % n, recvtag=RING_TAG
    )


def holders(size: int, held: dict) -> dict:
    """Which old rank's slices come from whom: ``held`` maps a survivor's old rank to
    the old ranks whose slices it holds (its own and its left neighbour's).

    Returns old rank -> the survivor (old rank) to take them from (the owner first).

    Raises:
      SlicesLost: some old rank's slices are held by no survivor.

    Example:
      >>> from jaxsync.elastic._shards import holders
      >>> holders(3, {0: (0, 2), 1: (1, 0)})  # rank 2 lost: rank 0 holds its copy
      {0: 0, 1: 1, 2: 0}
      >>> holders(3, {0: (0, 2)})  # ranks 1 and 2 lost: 1's slices only they held
      Traceback (most recent call last):
      ...
      jaxsync.elastic._shards.SlicesLost: ...
    """
    out: dict = {}
    for who in sorted(held):  # owners first, then copies
        out.setdefault(who, who)
    for who in sorted(held):
        for q in held[who]:
            out.setdefault(q, who)
    lost = [q for q in range(size) if q not in out]
    if lost:
        dead = sorted(set(range(size)) - set(held))
        raise SlicesLost(
            f"jaxsync.elastic: the sharded state's slices of rank(s) {lost} (of the "
            f"{size}-rank world of the agreed commit) are lost: each was held by its "
            f"rank and its ring neighbour rank + 1, and ranks {dead} are lost. "
            "Restore from a checkpoint (gather_state / shard_state) instead, or use "
            "the supervisor (python -m jaxsync elastic)."
        )
    return {q: out[q] for q in range(size)}


def rebuild(comm: Any, ring: dict, entries: dict, spec: dict) -> tuple[dict, dict]:
    """The sharded entries cut for the world of ``comm``, and the new ring copy.

    ``ring``: this survivor's ring record of the agreed commit (``size``, ``rank``,
    ``left``: the left neighbour's parts); ``entries``: the commit's entries (its own
    parts under the sharded names); ``spec``: name -> (inner optimizer, params entry).
    Collective over ``comm`` (an allgather of the parts the survivors hold).

    Returns:
      (name -> this rank's new ShardedState, name -> its new left neighbour's).
    """
    import jax

    from jaxsync.zero import gather_state, shard_state

    mine = {name: entries[name] for name in spec}
    n_old, r_old = ring["size"], ring["rank"]
    held = {r_old: mine}
    if n_old > 1:
        held[(r_old - 1) % n_old] = ring["left"]
    pool = comm.allgather((ring["gen"], n_old, r_old, held))
    gens = {(g, n) for g, n, _, _ in pool}
    if len(gens) != 1:
        raise SlicesLost(
            "jaxsync.elastic: the survivors hold the agreed commit's slices for different "
            f"worlds (generation, size: {sorted(gens)}): a process was lost during a "
            "restore. Restore from a checkpoint instead."
        )
    who = holders(n_old, {r: tuple(h) for _, _, r, h in pool})
    by_rank = {r: h for _, _, r, h in pool}
    m, me, dev = comm.Get_size(), comm.Get_rank(), jax.local_device_count()
    new, left = {}, {}
    for name, (inner, params_name) in spec.items():
        parts = [by_rank[who[q]][q][name] for q in range(n_old)]
        params = entries[params_name]
        whole = gather_state(inner, parts, params, replicas=dev * n_old)
        finite = parts[0].all_finite is not None

        def cut(p: int, inner=inner, whole=whole, params=params, finite=finite) -> Any:
            s = shard_state(
                inner, whole, params, replicas=dev * m, process=p, processes=m,
                check_finite=finite,
            )  # fmt: skip
            return jax.tree.map(_host, s)

        new[name] = cut(me)
        if m > 1:
            left[name] = cut((me - 1) % m)
    return new, left


def _host(x: Any) -> Any:
    import numpy as np

    return np.array(x, copy=True)
