"""metrics: where a loader's time goes, always on, per rank and per worker.

The contract, stage by stage (what is timed, where, and what it costs):

- In each worker (:mod:`.probe`), every item's fetch (its latency, retries and cache
  included, into a log-bucketed histogram) and its processor call; and what the
  worker's time went to (an :class:`~.probe.Activity`: decoding, waiting on fetches,
  idle). Each batch's numbers ride back on its result, a small dict.
- In the main process (:mod:`.loader`), each ``next()`` the training loop makes: the
  exposed stall (the wall time the loop waited in it), split into what it waited on:
  sampling (the index and sampler), the workers (split between the source and the
  decode by what the worker was doing), the hand-off (the result's way to the main
  process and the batch's assembly) and the copy to the device; the time between two
  ``next()`` calls is the consumer's (the training step). Queue depths (batches in
  flight, and how many were ready when asked) and the time to the first batch.
- A window (``metrics_window`` seconds, 10 by default; the first begins once the first
  batch is handed out) closes at the first ``next()`` after it ends, with a verdict
  (:func:`.loader.verdict`): bound by the ``source``, by ``decode``, by the ``workers``
  (hand-off, sampling, copy) or by the ``consumer`` (the loader is not the bottleneck).
  Each closed window is logged (INFO, logger ``distlearn.dataset.metrics``) and handed
  to the exporters (:mod:`.export`: TensorBoard's ``SummaryWriter`` or any callable).
- Across ranks (:mod:`.ranks`): each rank's totals since the last exchange, one row of a
  small tensor summed by one all_reduce: in a collective the job already makes (the
  tensor rides in its list), or in a call of its own, once per window. Every rank then
  names the straggler rank (the one whose loop waited on its loader the longest) and why.
- In a PyTorch trace (:mod:`.export`, ``stage``): the main-process stages as
  ``torch.profiler.record_function`` ranges, entered only while a profiler records.

Cost: two clock reads and an append per item and stage, a histogram increment per
fetch, a few dozen operations per batch; bench/metrics.py measures it against
``metrics=False`` (no timer at all).

Importing this package imports none of its modules; import them by name.
"""

__all__: list[str] = []
