"""`python -m server ...` is `flashnext serve ...`."""

from __future__ import annotations

import sys

from server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
