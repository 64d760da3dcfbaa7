"""`python -m scratchlm ...` (also what `torchrun -m scratchlm train ...` runs)."""

import sys

from scratchlm.cli import main

sys.exit(main())
