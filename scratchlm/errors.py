"""The one exception type for mistakes a user can fix (bad files, bad flags, bad configs).

Library code raises `ScratchlmError` with a message that names the problem (file, line, value, what was
expected). The CLI prints such errors as one line and exits with status 2, so a user mistake never ends in a
traceback; any other exception is a bug and keeps its traceback.
"""


class ScratchlmError(Exception):
    """A user-facing error: bad input, bad configuration, missing or malformed files."""
