"""``python -m offpolicy`` — the same CLI as the ``offpolicy`` command, found from the interpreter
(tests and scripts use it so that they never depend on PATH)."""

from __future__ import annotations

import sys

from offpolicy.cli import main

if __name__ == "__main__":
    sys.exit(main())
