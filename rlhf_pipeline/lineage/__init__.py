"""``rlhf lineage PATH``: where a DVC-tracked artifact came from, read through DVC's Python API
(``dvc.repo.Repo``) and git: the producing stage and its locked hashes, whether the workspace still
matches, the params it ran with and how they changed since, its inputs walked back to the sources,
the commit that recorded the lock, metrics, package versions and device.

:mod:`.record` reads DVC's record, :mod:`.facts` what the artifacts say about themselves,
:mod:`.event` builds the OpenLineage ``RunEvent`` (``--json``), :mod:`.render` the text report and
``rlhf lineage`` itself, and :mod:`.verify` the byte-for-byte check of ``--verify``. This package
marker imports none of them, so each loads only what it uses.
"""
