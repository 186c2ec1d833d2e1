import sys

from reflow_hpc.analyze.cli import main

sys.exit(main())
