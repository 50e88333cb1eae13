"""Command line: ``python -m vescale.debug.compare run_a/ run_b/ [--rtol R] [--atol A] [--stol S]``.

Prints the first tensor, in execution order, where two records of ``vescale.debug.record`` differ
beyond tolerance (step, module path, max abs/rel difference, worst elements), then a table of the
rest. Exit status: 0 the runs agree, 1 they differ, 2 the records cannot be compared.
The logic lives in ``vescale.debug.comparing`` (this module only runs it).
"""

import sys

from vescale.debug.comparing import main

if __name__ == "__main__":
    sys.exit(main())
