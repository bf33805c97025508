"""The Tinker-compatible HTTP API: the unmodified ``tinker`` SDK and tinker-cookbook train on an
OpenTinker cluster.

A fourth role beside the scheduler, the trainers and the client. It is a client of the scheduler
(one ``lora_session`` task per Tinker model, submitted with the caller's own key) and talks to
each session's ``TrainingService`` at the task's endpoint, so the scheduler stays off the data
path. Start it with ``python -m opentinker_gateway --scheduler HOST:PORT --port N``; see
docs/tinker.md.
"""
