"""Pure scheduling policy: placement (:mod:`.placement`) and victim choice (:mod:`.preemption`).
Frozen values in, a decision out: no gRPC, no store, no I/O (checked by ``make lint``)."""
