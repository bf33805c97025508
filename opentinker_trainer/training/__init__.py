"""Training primitives (``TrainingService``): the domain logic of a ``lora_session`` task.

* :mod:`.errors` — the refusals, each with the gRPC status it maps to (one table);
* :mod:`.datums` — a batch of datums, checked field by field (shapes, finiteness, vocabulary);
* :mod:`.losses` — ``cross_entropy``, ``importance_sampling``, ``ppo`` on one datum's tokens;
* :mod:`.sequencing` — per-session sequence numbers: in order, retries answered from a cache;
* :mod:`.session` — the session itself (adapter, gradient accumulation, AdamW, sampling,
  save/load), usable without a channel;
* :mod:`.server` — the thin grpc.aio adapter.
"""
