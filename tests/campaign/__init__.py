"""The hostile-world campaign: real processes, real kills, a database that goes away, and load.

``python -m tests.campaign kill|outage|load|fairness|memory|all`` (see ``__main__``):

- ``kill`` (``kill.py``): device processes (``device.py``: a ``SessionRuntime`` on its own
  SQLite file, turning and syncing) and ``pleach-server`` processes are SIGKILLed at seeded
  points in flushes, acknowledgements, pulls and turn commits, and restarted; at the end every
  committed user message is on the server and on every device of its user exactly once, and
  every chain verifies (``fleet.Fleet.verify``, on top of ``tests/sim/invariants.py``).
- ``outage`` (``outage.py``): ``pleach-server`` processes on PostgreSQL behind a fault-injecting
  TCP proxy (``faultproxy.py``) that cuts every connection, refuses new ones, or stalls; the
  devices write through it all; afterwards nothing is lost or doubled.
- ``load``, ``fairness``, ``memory`` (``load.py``, with light WebSocket devices in
  ``loadgen.py`` subprocesses): push-ack latency, server RSS and CPU under 1,000 devices; one
  honest tenant's p99 at rest and while another tenant floods; RSS after 1,000 idle connections
  open and after they close.

Figures are printed (and ``--json``), never asserted; ``tests/test_campaign.py`` asserts zero
loss and zero duplicates on a CI slice. docs/RELIABILITY.md publishes a run of each.
"""
