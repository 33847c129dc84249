"""`python -m ranktop` is the `ranktop` command."""

import sys

from ranktop.tui.cli import main

sys.exit(main())
