"""Searches that narrow a divergence or a failure to nodes: the pure search state (``state``,
which knows no ONNX), the cut search, the failure search over prefixes, and pattern windows.
"""
