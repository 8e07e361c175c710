"""Measurements behind docs/results/: run each from the repository root as ``python -m benchmarks.<name>`` (under
``accelerate launch -m benchmarks.<name>`` where it trains); shared helpers are imported as ``benchmarks.<module>``."""
