"""The data sources: what a worker reads, sample by sample, and in which order. Runs in the
worker (and, for the planning arithmetic, in the trainer).

One family over one planning core:

* ``_positions`` (layouts, positions, the batches a shard owes) and ``_epoch_order`` (an epoch's
  seeded order): pure arithmetic, no DALI, no I/O; the trainer uses them too.
* ``_sampling``: ``BatchedSamples`` (full batches of a shard, padding flagged, a saved position
  resumed) over any ``load(index)``.
* ``_files`` (files and ImageFolders, with ``_folder_index``), ``_tars`` (tar shards, with the
  tar index, summary, writer and indexer modules ``_tar_*``, ``_wds_idx``).
* ``_datasets``: the dataset definitions ``FilesDataset``, ``TarsDataset``, ``SamplesDataset``
  (what a mixture takes); ``_mix`` (``sharded_mix``); ``_sharded``: ``sharded_source``,
  ``sharded_files``, ``sharded_tars``, one call each over a dataset definition. Each module imports
  only those listed before it (no import circle).
* ``_storage`` (local ``pread`` or fsspec, identities, retries) and ``_index_file`` (mapped index
  files): the one storage layer they share.

May import: ``ipc``, the standard library, numpy, and from ``workers`` only ``_shard``,
``_control``, ``_dali`` and ``_timing`` (what a source needs of its worker). Never ``loader``.
Public names are re-exported by ``workers`` (and ``loader``).
"""
