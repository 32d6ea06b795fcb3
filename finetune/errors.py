"""The one exception type for user errors, and what turns a recipe's `module:attribute` into its callable."""

import importlib
from typing import Any


class FinetuneError(Exception):
    """A problem with the user's input: the CLI prints the message on one line and exits with status 2.

    Messages say what is wrong and what to do about it. Bugs and invariant violations use other
    exception types and keep their tracebacks.
    """


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    return (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__


def imported(name: str, setting: str, what: str) -> Any:
    """The callable a recipe names as `module:attribute` (`setting` says where, `what` what it should be), or one
    line saying why it cannot be had and how to name one."""
    module, _, attribute = name.partition(":")
    try:
        found = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise FinetuneError(
            f"{setting}={name} cannot be imported ({first_line(exc)}); name a module on the Python path and "
            f"{what} in it as module:attribute"
        ) from None
    except Exception as exc:  # the module itself fails: a syntax error, or an exception while it runs
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        message = exc.msg if isinstance(exc, SyntaxError) else first_line(exc)
        raise FinetuneError(
            f"{setting}={name}: importing {module} failed with {type(exc).__name__}: {message}{where}; fix the "
            f"module (python -c 'import {module}' shows the traceback)"
        ) from None
    if not callable(found):
        raise FinetuneError(f"{setting}={name} is not callable; name {what} as module:attribute")
    return found
