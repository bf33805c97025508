"""The deployment guide's scheduler command, run from a checkout or the image's working folder::

    python scheduler.py --config scheduler_config.yaml --port 8888

The same code as ``python -m opentinker_scheduler`` (and the ``opentinker-scheduler`` console
script), with the same flags (``--help``). From a checkout that is not installed, the generated
stubs in ``protos/`` are put on the import path.
"""

import sys
from pathlib import Path

_PROTOS = Path(__file__).resolve().parent / "protos"
if _PROTOS.is_dir() and str(_PROTOS) not in sys.path:
    sys.path.append(str(_PROTOS))

from opentinker_scheduler.__main__ import main  # noqa: E402  (after the path above)

if __name__ == "__main__":
    sys.exit(main(prog="scheduler.py"))
