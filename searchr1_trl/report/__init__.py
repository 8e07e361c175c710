"""The trace report: a training run's folder or a ``searchr1-eval`` folder as one HTML page that opens offline.

``folders`` reads what the trainer and ``searchr1-eval`` write, ``traces`` turns one trace into what the page shows
and compares two sets of traces, ``figures`` draws the curves, ``page`` renders it all into one file.
"""
