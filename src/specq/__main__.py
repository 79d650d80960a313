"""`python -m specq ...` is the `specq` command."""

import sys

from specq.api.command import main

sys.exit(main())
