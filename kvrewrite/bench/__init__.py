"""Benchmark scripts, run as ``python -m kvrewrite.bench.<name>`` (GPU; not imported by kvrewrite)."""
