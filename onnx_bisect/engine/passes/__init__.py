"""Pass bisection: which of the target's optimizer passes causes a divergence (``bisection``),
on which subgraph (``scope``), by which pure search over sets of passes (``search``), and
torch.compile targets through torch's own bisector (``compiled``).
"""
