"""CSV/TSV indexes: ``filename``, ``label*`` and optional ``offset``/``length`` columns.

:func:`from_csv` (in :mod:`.reader`) splits the file with the first reader that vouches
for its rows and builds an Index from the fields; :mod:`.meta` reads the URL prefix
beside the index.

Importing this package imports none of its modules (each stage is loaded by what
uses it); import the modules by name.
"""

__all__: list[str] = []
