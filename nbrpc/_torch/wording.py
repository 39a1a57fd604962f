"""torch's error wording: what nbrpc recognises in the text of torch's RuntimeErrors.

torch raises RuntimeError for timeouts, lost peers, unpicklable calls and unknown
destinations alike; only the text tells them apart, so each text lives here, pinned.
"""

from __future__ import annotations

import re

# -- torch's error wording ----------------------------------------------------------------


def is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("timeout" in text.lower() or "timed out" in text)


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def missing_module(exc: BaseException) -> str | None:
    """The module a worker failed to import while unpickling a call, else ``None``."""
    if not isinstance(exc, RuntimeError) or "deserialize" not in str(exc):
        return None
    match = _NO_MODULE.search(str(exc))
    return match.group(1) if match else None


#: how torch begins the text of an error the callee sent back
ON_NODE = "Error on Node "


def missing_module_here(exc: BaseException) -> str | None:
    """The module this process failed to import while unpickling a reply, else ``None``:
    torch's text of a deserialization with no node named (a callee's error begins with
    :data:`ON_NODE`), or the error itself (a lane's reply is unpickled by nbrpc)."""
    if isinstance(exc, ModuleNotFoundError):
        return exc.name
    if ON_NODE in str(exc):
        return None
    return missing_module(exc)


_SERIALIZATION = re.compile(r"SerializationError: (.*?)(?:\n\nAt:|\nException raised from|$)", re.S)


def serialization_failure(exc: BaseException) -> str | None:
    """nbrpc's pickler refused a result on the callee (torch's C++ turned the error into a
    RuntimeError, C++ frames appended): its message, else ``None``."""
    if not isinstance(exc, RuntimeError):
        return None
    match = _SERIALIZATION.search(str(exc))
    return match.group(1).strip() if match else None


CONNECTION_LOST = (
    "eof (this error originated at tensorpipe",  # the shm transport's wording
    "EOF: end of file (this error originated at tensorpipe",  # the uv transport's
    "ECONNREFUSED",
    "ECONNRESET",
    "EPIPE",
    "pipe closed",
    "Connection reset by peer",
)


#: torch's words when a handle names a worker id its agent does not know: an RRef whose
#: owner left the group (a worker that died, or one of an earlier cluster).
UNKNOWN_DESTINATION = "could not find destination id"
#: torch's hint when a callee cannot find the function a call names (its unpickler's
#: AttributeError; torch's caller gets it as a RuntimeError)
NOT_ON_CALLEE = "RPC pickler does not serialize"


def is_connection_loss(exc: BaseException) -> bool:
    """Whether torch's error means the peer's process went away (TensorPipe's wording)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in CONNECTION_LOST)


_UNDEFINED_SCRIPT = re.compile(r"attempted to get undefined function (\S+)")


def undefined_script_function(exc: BaseException) -> str | None:
    """The TorchScript function a callee does not know (torch's caller gets its
    ``get_function`` failure as a RuntimeError, C++ frames appended), else ``None``."""
    if not isinstance(exc, RuntimeError):
        return None
    match = _UNDEFINED_SCRIPT.search(str(exc))
    return match.group(1) if match else None
