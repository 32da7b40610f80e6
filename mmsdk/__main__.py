"""``python -m mmsdk`` runs the command line interface."""

from mmsdk.cli import main

raise SystemExit(main())
