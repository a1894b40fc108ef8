"""pleach benchmarks: ``python -m bench [--quick] [--json PATH]`` (see docs/BENCHMARKS.md)."""
