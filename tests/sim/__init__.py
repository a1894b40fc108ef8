"""A seeded simulation of devices, a sync server and faults, proving "nothing a user wrote is
ever lost" by checking invariants after every schedule (see docs/RELIABILITY.md).

``schedule`` generates schedules from one seed, ``network`` is the per-device proxy that
delays, reorders and cuts, ``harness`` plays a schedule against real runtimes and a real
server, ``invariants`` checks the quiet world, ``shrink`` minimises a failing schedule.
Run ``python -m tests.sim --seed N`` to replay one seed.
"""
