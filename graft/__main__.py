import sys

from graft.tools.cli import main

sys.exit(main())
