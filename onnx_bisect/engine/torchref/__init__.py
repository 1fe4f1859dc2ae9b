"""PyTorch-reference mode (``--ref pytorch:FILE.py:FACTORY``): the module run with hooks on
every submodule (``capture``), each module's output mapped to the ONNX tensor that stands for
it (``mapping``), compared on the target, and the first divergent module's ONNX nodes fed its
own inputs in float64 to tell a wrong translation from a wrong kernel (``cause``, ``run``).
"""
