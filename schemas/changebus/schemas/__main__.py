"""``python -m changebus.schemas`` runs the ``changebus`` command."""

import sys

from ._cli import main

sys.exit(main())
