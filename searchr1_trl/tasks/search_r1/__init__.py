"""The Search-R1 task on the engine: the question stream (``data``), the ``search`` tool (``env``) and exact-match
rewards (``rubric``). A new tool-calling task is another folder like this one."""
