"""``python -m merak_core.cli``: the ``merak`` command."""

import sys

from merak_core.cli.main import main

sys.exit(main())
