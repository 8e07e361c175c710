"""The generic multi-turn tool engine: turns, budgets and token masks (``rollout``), messages <-> tokens
(``transcript``), assistant text -> message + tool calls (``parsing``), and the generation backends (``generation``:
the contract and the vLLM server's client; ``in_process``: the trained model itself). Nothing here knows a task."""
