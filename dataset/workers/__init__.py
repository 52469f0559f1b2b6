"""workers: fetch and decode each batch's items straight into a slot of the batch ring.

The :class:`SlotEngine` (:mod:`.ring`) takes batches of work into free slots of a ring of
preallocated tensors and gives them back in order, the failure policy
(:mod:`.failures`) applied. Its workers are threads (:mod:`.threads`) or processes
(:mod:`.processes`), both running :func:`fill` (:mod:`.fill`).

Importing this package imports none of its modules (each stage is loaded by what
uses it); import the modules by name.
"""

__all__: list[str] = []
