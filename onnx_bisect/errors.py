"""The one error hierarchy. The CLI turns these into one-line messages with exit code 2."""

from __future__ import annotations

__all__ = [
    "BackendCrash",
    "BackendError",
    "BackendUnavailableError",
    "InputError",
    "ModelLoadError",
    "OnnxBisectError",
    "SpecError",
    "WorkerCrash",
]


class OnnxBisectError(Exception):
    """Base class: a problem with what the user asked for, not a bug in onnx-bisect.

    ``option``: the parameter of ``bisect()`` the problem is with, when it is one option's
    value; the message then begins with that name, which a command line swaps for its flag
    (``threshold must be ...`` reads ``--threshold must be ...`` there).
    """

    def __init__(self, message: str, *, option: str | None = None) -> None:
        if option is not None and not message.startswith(option):
            raise ValueError(f"a message about {option!r} must begin with it: {message!r}")
        super().__init__(message)
        self.option = option


class ModelLoadError(OnnxBisectError):
    """The model file is missing, unreadable or not a valid ONNX model."""


class InputError(OnnxBisectError):
    """Input tensors or shapes do not fit the model's signature."""


class SpecError(OnnxBisectError):
    """A backend spec could not be parsed or names an unknown backend."""


class BackendUnavailableError(OnnxBisectError):
    """The backend exists but cannot run on this machine (missing package, provider, OS)."""


class BackendError(OnnxBisectError):
    """A backend failed while loading or running a model."""

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        role: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.node = node
        self.role = role  # "ref" or "target" once the search knows which side failed
        # The runtime's whole message: the one-line ``message`` is cut to fit a terminal, and
        # a finding must keep what the runtime said (OpenVINO's summary comes last).
        self.detail = detail

    @property
    def full(self) -> str:
        return self.detail or str(self)


class BackendCrash(BackendError):
    """The backend's process died (a signal) or hung past the timeout: it did not just fail."""


class WorkerCrash(BackendCrash):
    """A worker process running tasks in parallel died; ``index`` is the task it was running,
    when that is known."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index
