"""The scheduler's state: the core state machine (tasks, attempts, nodes, the GPU ledger), its
durable store, group commit, the in-memory queue, node sessions, the node protocol and the
bookkeeping of preemptions in flight. No gRPC here; policy decisions come from :mod:`..policy`."""
