"""CSV/TSV indexes: ``filename``, ``label*`` and optional ``offset``/``length`` columns.

:func:`~.reader.from_csv` reads the file with the first of the declared readers
(:data:`~.reader.READERS`: ``lines`` in C, ``arrow`` by pyarrow, ``csv`` by the csv
module) that reads it, each keeping one contract (:mod:`.contract`): the same rows as
the csv module's, or none. :mod:`.meta` reads the URL prefix beside the index;
:mod:`.text` holds the byte-level rules the fast readers check.

Importing this package imports none of its modules (each stage is loaded by what
uses it); import the modules by name.
"""

__all__: list[str] = []
