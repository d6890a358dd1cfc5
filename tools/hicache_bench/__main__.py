"""``python -m hicache_bench``: the same as ``hicache-bench``."""

import sys

from hicache_bench.cli import main

sys.exit(main())
