"""index: what a Dataset draws from, opened from any kind of index into an :class:`Index`.

:func:`open_index` (in :mod:`.kinds`) is the one dispatch on the kind of index: a CSV/TSV
file (:mod:`.csv`), a directory, tensors or a ``.pt`` file, a folder of part files
(:mod:`.parts`), or a list of these joined item by item (:mod:`.joined`). An Index holds
no Python object per row (:mod:`.rows`) and partitions by label (:mod:`.table`).

Importing this package imports none of its modules (each stage is loaded by what
uses it); import the modules by name.
"""

__all__: list[str] = []
