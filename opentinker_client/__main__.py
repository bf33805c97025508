"""``python -m opentinker_client`` runs the ``opentinker`` command."""

import sys

from opentinker_client.cli.commands import main

sys.exit(main())
