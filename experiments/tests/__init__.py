"""Tests of the lab notebook's own code (benchmarks, variants), run by CI beside tests/ (pyproject's testpaths)."""
