"""Multi-step mode (``--steps``): the model run step after step in lockstep on both sides,
each step fed from the one before (``loop``); the first step that diverges is then diagnosed
like a single input, on that step's inputs.
"""
