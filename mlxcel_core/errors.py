"""Errors the core raises for the CLI and the server to translate.

`InputError` is the user's fault (bad path, bad option value, broken file): CLI exit 2, HTTP 4xx.
`RuntimeFailure` is ours or the machine's (out of memory, a backend error): CLI exit 1, HTTP 5xx.
"""


class MlxcelError(Exception):
    """Base class; the message is one line meant for the user."""

    exit_code = 1


class InputError(MlxcelError):
    exit_code = 2


class ModelNotFoundError(InputError):
    pass


class UnsupportedModelError(InputError):
    pass


class CorruptModelError(InputError):
    pass


class RuntimeFailure(MlxcelError):
    exit_code = 1
