"""Tasks on the engine: each folder is one task's question stream, tool environment and rubric."""
