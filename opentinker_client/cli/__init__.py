"""The ``opentinker`` command: task, node, key and operations subcommands (:mod:`.commands`)."""
