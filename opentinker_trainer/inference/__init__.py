"""Serving a base model and many LoRA adapters: ``opentinker.inference.v1.InferenceService``.

* :mod:`.sampling` — next-token choice (temperature, top-k, top-p as ``transformers`` does it)
  and raw log-probabilities;
* :mod:`.engine` — one request's decode loop (prefill once, ``n`` samples per step);
* :mod:`.batch` — continuous batching: many requests' rows (any adapters) in one forward pass;
* :mod:`.text` — incremental detokenization and stop strings;
* :mod:`.adapters` — adapter validation, loading on demand, least-recently-used bound;
* :mod:`.runtime` — the served model: one engine task, bounded queue, first-in-first-out admission;
* :mod:`.resolve` — adapter name (a finished task's id) -> checkpoint folder, via the scheduler;
* :mod:`.access` — who may call: the scheduler asked with the caller's endpoint token, cached;
* :mod:`.tls` — the server's certificate and key (``--serve-tls-cert`` / ``--serve-tls-key``);
* :mod:`.server` — the gRPC servicer with health and reflection.

The ``inference`` workload (:mod:`opentinker_trainer.workloads.serving`) puts them together.
"""
