"""Which runtime messages say "I lack this op" rather than "I failed running it".

One table for every runtime, matched against the whole message lower-cased: a failure whose
message holds one of these phrases is reported as ``unsupported`` (a missing kernel or
conversion), any other as an error. Each row names the runtime whose wording it is, so a new
runtime's phrases are added here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PHRASES", "Phrase", "unsupported", "unsupported_phrase"]


@dataclass(frozen=True)
class Phrase:
    text: str  # lower-case
    runtimes: str  # whose wording it is, for the reader of this table


PHRASES: tuple[Phrase, ...] = (
    Phrase("not implemented", "ONNX Runtime ([ONNXRuntimeError] : 9 : NOT_IMPLEMENTED), many"),
    Phrase("not_implemented", "ONNX Runtime's status code"),
    Phrase("unimplemented", "tract: Unimplemented(Det)"),
    Phrase("unsupported", "many"),
    Phrase("no op registered", "ONNX Runtime: no op registered for a custom domain"),
    Phrase("could not find an implementation", "ONNX Runtime: a kernel for these types"),
    Phrase("is not supported", "tinygrad: NotImplementedError: op='LSTM' is not supported"),
    Phrase("are not supported", "TVM: The following operators are not supported for frontend"),
    Phrase("opnotimplemented", "TVM: tvm.error.OpNotImplemented"),
    Phrase("failed to legalize operation", "IREE: failed to legalize operation 'torch.operator'"),
    Phrase("cannot create", "OpenVINO: Cannot create X layer"),
    Phrase("doesn't support", "many"),
    Phrase("does not support", "many"),
    Phrase("conversion is failed", "OpenVINO: Summary: Conversion is failed for: Concat-13"),
    Phrase("no conversion rule", "OpenVINO: No conversion rule found for operations: ..."),
    Phrase("wasn't fully converted", "OpenVINO: OpConversionFailure: Model wasn't fully converted"),
)


def unsupported_phrase(message: str) -> Phrase | None:
    """The table's first phrase in ``message``, or None."""
    text = message.lower()
    return next((p for p in PHRASES if p.text in text), None)


def unsupported(message: str) -> bool:
    """Whether a runtime's message says it lacks the op, rather than failed running it."""
    return unsupported_phrase(message) is not None
