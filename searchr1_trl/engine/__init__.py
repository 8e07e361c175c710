"""The generic multi-turn tool engine: turns, budgets and token masks (``rollout``), assistant text -> message +
tool calls (``parsing``), and the generation backends (``generation``). Nothing here knows a task."""
