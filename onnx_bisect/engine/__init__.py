"""The diagnosis: a session, the runs that observe the backends, and the pure judging of them.

Stages: ``observe`` (screen, scan), ``isolate``, ``judge``, ``cut`` (cut search), ``crash``,
``pattern``, ``chain``; ``strategies`` puts them in order for each kind of target.
"""
