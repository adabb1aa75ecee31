"""The line between a user's mistake and a bug.

`UserError` is the base of every error a user can fix without reading code: a bad recipe, a missing
or unreadable model, a damaged artifact, a wrong target, a bad command-line value, a request the
engine cannot serve. Its message is one line that names the file, key or value and what is allowed.
The CLI prints it and exits 2. Every other exception is a bug: the CLI shows its traceback and exits 1.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message says what and how."""


class InputError(UserError, ValueError):
    """A value the user gave that cannot be used: an option, a request's field, a data file's content.

    `field`, when given, names the request field at fault (`"seed"`, `"max_tokens"`, `"prompt"`), so a
    caller such as the server can point at it (its 400's `param`) without reading the message.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedModelError(UserError, ValueError):
    """A checkpoint config no model family can express; the message names the file, the value and what is
    supported. (Raised by optc.frontend.models and its family modules.)"""
