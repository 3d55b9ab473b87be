"""python -m services.harness: the built-in harness process (same as gyre-harness)."""

import sys

from services.harness.harness import main

sys.exit(main())
