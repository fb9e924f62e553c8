"""`python -m fusecli` runs the command line."""

import sys

from fusecli.commands.main import main

sys.exit(main())
