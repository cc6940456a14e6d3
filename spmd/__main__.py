"""`python -m spmd ...`: the command line (see `spmd.cli`)."""
from spmd.cli import main

raise SystemExit(main())
