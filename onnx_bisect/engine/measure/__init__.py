"""Measuring the backends: timed runs, probe runs in memory-bounded chunks, the store of the
reference's values, the memory plan, and isolation (each node fed the reference's operands).

Everything above it (the searches, the oracle, pass bisection, the strategies) asks its
questions through these runs; nothing here decides a verdict.
"""
