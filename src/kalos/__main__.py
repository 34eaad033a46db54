import sys

from kalos.cli import main

sys.exit(main())
