"""The diagnosis: a session, the runs that measure the backends, the searches, and the pure
judging of what they measured.

At the top: ``diagnose`` (prepare, open a session, diagnose, build the result), ``strategies``
(the order of stages for each kind of target), ``session``, ``judge`` (every verdict, pure),
``found``, ``chain``, ``precision``, ``control_flow``, ``recorded`` and ``subgraphs``. Rooms:
``measure`` (runs, store, memory plan, observe, isolate), ``search`` (cut, failure, pattern),
``oracle`` (float64), ``passes`` (pass bisection) and ``dataset`` (dataset mode, workers).
"""
