"""Dataset mode: the per-input work (``job``), the statistics over inputs (``stats``, pure), and
independent tasks in-process, in worker processes or on Ray (``parallel``, ``pool``,
``ray_tasks``, ``worker``).
"""
