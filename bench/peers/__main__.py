"""``python -m bench.peers [--quick] [--install] [--json [PATH]]``: see ``bench.peers.runner``."""

from __future__ import annotations

import sys

from bench.peers.runner import main

if __name__ == "__main__":
    sys.exit(main())
