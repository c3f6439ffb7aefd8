"""`python -m shardtensor.demo --help`."""

from .cli import main

raise SystemExit(main())
