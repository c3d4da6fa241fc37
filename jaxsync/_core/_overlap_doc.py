"""The overlap options' docstring text, added to every MPI factory's docstring
(``document_overlap``).

Imports: the standard library only; ``_transforms`` and ``jaxsync.auto`` import it.
"""

from __future__ import annotations

import inspect

# The three options, as every MPI factory documents them (``document_overlap``).
_ARGS = """      overlap: ``True`` sends the gradients in buckets, in the order backward
        produces them (the tree's leaves last to first), each bucket as soon as
        it exists; with MPI on CPU the sums run on a communication thread while
        the step computes on (see "Overlap" in docs/strategies.md). The same bits as
        ``False``. The buckets' order assumes the tree lists the model's layers
        first to last. ``"auto"`` (default): on where the inter-process stage
        spans more than one host (MPI, the topology's host count) on jaxsync's
        native CPU target, off within one host, without MPI, and where MPI
        blocks (mpi4jax on GPU, ``staging="host"``). ``True`` without an inter-process stage (one
        process) hides nothing, and the factory warns.
      overlap_bucket_bytes: with ``overlap``, about this many bytes per bucket
        (``"auto"``: 4 MiB; the first bucket 1 MiB).
      double_buffering: ``True`` applies, at step ``t``, the mean of the
        gradients of step ``t - 1`` (ChainerMN's ``double_buffering``): step
        ``t``'s local gradients are kept in the state, and their reduction
        runs during step ``t + 1``'s forward and backward. The first step
        applies zeros (the state starts from zero gradients; ChainerMN skips
        its first update): plain SGD leaves the parameters unchanged, an
        optimizer after this transform sees one zero gradient. The gradients
        of the last step are in the state and never applied. A checkpoint of
        the state taken between steps resumes the same run bit for bit. The
        step of staleness costs accuracy on a short run (see docs/strategies.md);
        without an inter-process stage (one process) there is nothing to hide
        and the factory warns.
      weights: ``True``: ``update`` takes ``weight=`` (a scalar per replica; 1 by default) and
        ``done=`` (no data after this step) and returns ``sum(w g) / sum(w)`` (0 if all are 0);
        ``"world"``: ``sum(w g) / n``. See :func:`jaxsync.all_done`, docs/strategies.md.
      early_termination: ``"join"`` (default): replicas out of data join (zeros at weight 0)
        until every replica is done; ``"raise"`` (with ``weights=``; Horovod's
        ``throw_on_early_termination``): a step where some but not all replicas pass
        ``done=True`` raises ``RuntimeError`` on every replica.

"""


# ``host_tier``, as the factories that may take the host tier document it.
_HOST_TIER_ARG = """      host_tier: the host tier (MPI on CPU, several hosts, several processes on
        a host): a host's processes reduced first, then one process per host
        (or each local rank's slice) across hosts, then the host's result
        (see "The host tier" in docs/strategies.md). ``"auto"`` (default):
        for a synchronisation most of whose bytes are 16-bit on the wire
        (``comm_dtype=jnp.bfloat16``, bfloat16 parameters), where it always
        sends fewer bytes across hosts; float32 keeps MPI's own allreduce.
        ``True``: whenever the topology has one; ``False``: never.
        ``JAXSYNC_HOST_TIER=1`` / ``0`` overrides it for every transform.
"""


def document_overlap(factory):
    """Add ``overlap``, ``overlap_bucket_bytes`` and ``double_buffering`` (and
    ``host_tier``, ``weights``, where the factory takes them) to a factory's
    docstring (before ``Returns:``), and the state they make."""
    doc, takes = factory.__doc__, inspect.signature(factory).parameters
    at = doc.index("\n    Returns:")
    args = _ARGS.rstrip("\n") if "weights" in takes else _ARGS[: _ARGS.index("      weights:")]
    if "weights" in takes and "early_termination" not in takes:
        args = args[: args.index("      early_termination:")]
    args = (_HOST_TIER_ARG if "host_tier" in takes else "") + args.rstrip("\n")
    doc = doc[:at] + "\n" + args + doc[at:]
    doc = doc.replace(
        "      ``check_finite``.\n",
        "      ``check_finite``; with ``double_buffering``,\n"
        "      :class:`jaxsync.DoubleBufferState`.\n",
        1,
    )
    factory.__doc__ = doc
    return factory
