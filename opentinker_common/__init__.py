"""The contract layer that client, scheduler and trainer share, beside the generated stubs
(package ``opentinker``): torch-free, gRPC-servicer-free, and importing none of the three roles.

* :mod:`opentinker_common.spec`: task specs as typed, validated values (the submit contract).
* :mod:`opentinker_common.net`: channel credentials and PEM checks, server TLS contexts, bearer
  keys on calls, the HTTP side-port server, gRPC options and message limits, scheduler URLs,
  transport-error wording.
* :mod:`opentinker_common.logs`: logging configuration (structlog) for every process.
* :mod:`opentinker_common.yaml12`: the YAML 1.2 loader of every config file.
* :mod:`opentinker_common.arithmetic`: the built-in arithmetic problems and their reward.
* :mod:`opentinker_common.datasets`: dataset limits shared by upload and reading.
"""
