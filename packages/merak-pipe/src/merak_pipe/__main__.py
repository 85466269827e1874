"""``python -m merak_pipe`` runs the ``merak-pipe`` command line."""

from merak_pipe.cli import main

raise SystemExit(main())
