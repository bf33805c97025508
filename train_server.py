"""The deployment guide's trainer command (the CMD of its image)::

    SCHEDULER_URL=http://scheduler-host:8888 python train_server.py

The same code as ``python -m opentinker_trainer`` (and the ``opentinker-trainer`` console
script): it reads ``SCHEDULER_URL`` (``http://host:port`` or plain ``host:port``), ``NODE_ID``,
``MAX_TASKS`` and the other variables and flags ``--help`` lists. From a checkout that is not
installed, the generated stubs in ``protos/`` are put on the import path.
"""

import sys
from pathlib import Path

_PROTOS = Path(__file__).resolve().parent / "protos"
if _PROTOS.is_dir() and str(_PROTOS) not in sys.path:
    sys.path.append(str(_PROTOS))

from opentinker_trainer.__main__ import main  # noqa: E402  (after the path above)

if __name__ == "__main__":
    sys.exit(main(prog="train_server.py"))
