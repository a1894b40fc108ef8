"""pleach beside its peers: ``make bench-peers`` (``python -m bench.peers --help``).

The same workloads run on pleach and on peer libraries in one run, each beside a floor
measured in that run (a raw ``sqlite3`` writer, a raw ``websockets`` relay or echo of the same
bytes). Peers live in their own virtual environment, ``.venv-peers``; pleach runs from the
project's ``.venv``. Every measurement runs in a subprocess of its own that prints its figures
as one JSON line; ``bench.peers.runner`` collects them, prints the tables and writes
``bench/results-peers.json``. See ``bench/peers/README.md``.

Nothing in this package imports a third-party library at module level except the module of
the peer (or of pleach) that needs it, so each side imports only what its venv has.
"""
