"""Training features not yet shown to win and be stable: asynchronous rollouts (``async_rollouts``) and, within
them, pausing rollouts in flight for a weight push (``in_flight_rollouts: pause``).

They are off by default, apart from the core path (as TRL keeps its async trainer in ``trl.experimental``), and
each warns once per process when a recipe switches it on (:func:`warn_experimental`), saying what is known of it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_warned: set[str] = set()  # the features warned about in this process


def warn_experimental(feature: str, known: str) -> None:
    """Warn, the first time in this process only, that ``feature`` is experimental and what is ``known`` of it."""
    if feature in _warned:
        return
    _warned.add(feature)
    logger.warning("%s is experimental (searchr1_trl/training/experimental): %s", feature, known)
