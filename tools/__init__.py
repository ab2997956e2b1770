"""Benchmarks, experiments and the `writescope` command line (the top layer: tools -> actors -> core)."""
