"""`python -m robustbn.cli`: the same as the `robustbn` command."""

import sys

from . import main

sys.exit(main())
