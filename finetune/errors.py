"""The one exception type for user errors."""


class FinetuneError(Exception):
    """A problem with the user's input: the CLI prints the message on one line and exits with status 2.

    Messages say what is wrong and what to do about it. Bugs and invariant violations use other
    exception types and keep their tracebacks.
    """
