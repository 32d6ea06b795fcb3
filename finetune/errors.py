"""The one exception type for user errors."""


class FinetuneError(Exception):
    """A problem with the user's input: the CLI prints the message on one line and exits with status 2.

    Messages say what is wrong and what to do about it. Bugs and invariant violations use other
    exception types and keep their tracebacks.
    """


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    return (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
