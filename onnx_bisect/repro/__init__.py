"""Repro bundles: the smallest subgraph that still diverges, as an ONNX test case + repro.py."""
