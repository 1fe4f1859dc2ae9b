"""The float64 oracle behind ``--threshold auto``: every probe in float64 and in its fp32 twin,
computed by torch in a process of its own (``child``, running ``job``), ``onnx.reference`` as
the fallback (``float64``).
"""
