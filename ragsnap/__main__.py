import sys

from ragsnap.cli import main

sys.exit(main())
