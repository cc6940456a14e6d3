"""`python -m spmd ...`: the command line (see `spmd.tools.cli`)."""
from spmd.tools.cli import main

raise SystemExit(main())
