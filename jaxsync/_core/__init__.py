"""The core: one synchronisation of a dense gradient tree, from options to optax.

Data flow: ``_options`` (``SyncOptions``: each shared option's one text) and
``_config`` (the factories' options, validated once) → ``_plan`` (the
packing plan: buffers per dtype, buckets) → ``_strategies`` (the intra and inter
stages of each strategy, over ``jaxsync._comm``'s collectives and backends) →
``_sync`` (pack, reduce, unpack; ``sync_gradients``) → ``_transforms`` (the optax
factories). ``_overlap`` runs a strategy per bucket while backward computes;
``_broadcast`` sends rank 0's parameters; ``_replica`` averages non-gradient
values (``replica_mean``). The optional areas (``jaxsync.sparse``,
``jaxsync.auto``) plug in through ``_plugins``; nothing here imports them.
"""
