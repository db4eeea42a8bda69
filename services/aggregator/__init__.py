"""The aggregator: consumes the metric/event bus and applies it to the search-plan database (ARCHITECTURE §2).

- :mod:`.aggregator` :class:`Aggregator`, the consumer loop (poll a batch, apply it in one transaction,
  commit offsets after the database commit, wake the master)
- :mod:`.settings`   :class:`AggregatorSettings` (``STAGETREE_AGG_*``)
- :mod:`.cli`        ``stagetree aggregator run``

The database side of the apply (batched, idempotent) is ``stagetree.master.store.ingest.Ingestor``.
Import the classes from their modules: this package imports nothing on its own, so ``stagetree --help``
stays light.
"""
