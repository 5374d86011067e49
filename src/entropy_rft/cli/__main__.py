"""``python -m entropy_rft.cli ...`` runs ``erft ...``."""

import sys

from entropy_rft.cli.main import main

sys.exit(main())
