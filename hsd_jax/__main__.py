import sys

from hsd_jax.cli import main

sys.exit(main())
