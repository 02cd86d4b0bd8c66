import sys

from graft.cli import main

sys.exit(main())
