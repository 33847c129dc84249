"""`python -m ranktop` is the `ranktop` command."""

import sys

from ranktop.command import main

sys.exit(main())
