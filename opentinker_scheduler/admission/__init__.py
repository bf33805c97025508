"""What SubmitTask checks before a task exists: per-caller limits, the spec's environment (off
the event loop), local paths, and what the spec refers to (datasets, ``init_from``)."""
