"""sampling: which items each batch holds, epoch after epoch, in the main process only.

Samplers (:mod:`.samplers`, pluggable with :func:`register_sampler`) give one epoch's
order from a generator seeded by (seed, partition, epoch); the item stream
(:mod:`.stream`) cuts it into batches of work and keeps the position for
``state_dict()``. Workers never sample, so no item is duplicated or skipped whatever
their number.

Importing this package imports none of its modules (each stage is loaded by what
uses it); import the modules by name.
"""

__all__: list[str] = []
