"""The agent's exceptions: what a handler raises to answer with an error, and what ends a connection.

    Exception
     ├── ApiError      answered as {"error": {"code", "message"}} with its status; the connection
     │                 stays open (connection.Conn turns it into the response)
     ├── BadRequest    the request cannot be parsed: answered with its status, then the connection ends
     └── PeerGone      the client closed or reset the connection: stop serving it quietly

`invalid` and `invalid_path` make the two 400 ApiErrors. Raised by every handler module and by
`connection`. `NotRunnable` is not an error of the API: the exec answers with its exit status
(126/127 when exec() failed, 137 when the init died while starting the command).
"""

from __future__ import annotations


class ApiError(Exception):
    """An error reported to the client as {"error": {"code", "message"}}."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)


def invalid_path(message: str) -> ApiError:
    return ApiError(400, "invalid_path", message)


class PeerGone(Exception):
    """The client closed or reset the connection; stop serving it quietly."""


class BadRequest(Exception):
    """The request cannot be parsed; answer with an error and end the connection."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class SpawnFailed(Exception):
    """A command could not be started for a reason other than an OSError or a bad argument (what
    subprocess raises as SubprocessError: a terminal that could not become the controlling tty)."""


class NotRunnable(Exception):
    """The command did not run the way a shell reports it: exec() failed (126/127), or the
    sandbox's process init was killed while it started it (137)."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message
