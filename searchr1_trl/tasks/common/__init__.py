"""What the tasks share, no task itself: the question stream (``data``), the exact-match rubric (``rubric``), the
retrieval client (``retrieval``) and the ``search`` tool of the search tasks (``search``)."""
