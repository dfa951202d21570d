"""`python -m nanoqwen ...` is the `nanoqwen` command."""

from .cli import main

raise SystemExit(main())
