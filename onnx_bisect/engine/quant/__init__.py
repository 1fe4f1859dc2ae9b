"""A quantized target model of a float one (issue 27): its integers paired with the float
model's tensors in real units (``pairing``), the per-tensor quantization table (``table``), the
verdicts it implies (``verdicts``), the smallest set of nodes to keep in float (``keep``), and
the stage that joins them (``conclude``).
"""
