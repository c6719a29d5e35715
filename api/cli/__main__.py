"""`python -m api.cli`: the `dss` command."""

import sys

from api.cli import main

sys.exit(main())
