"""The lab notebook: the measurements behind experiments/results/ and docs/results/, run from the repository root as
``python -m experiments.<name>`` (under ``accelerate launch -m experiments.<name>`` where it trains). Nothing in the
package, its scripts or its tests imports this folder (tests/test_architecture.py)."""
