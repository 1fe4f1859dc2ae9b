"""Sweeps: many (model, target) cases, each diagnosed by ``bisect`` in a process of its own
(``sweep()`` in ``run.py``); the result data is ``sweep_result``'s, the files ``report/``'s."""

__all__: list[str] = []
