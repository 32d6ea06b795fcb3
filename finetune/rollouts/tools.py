"""What an episode's calls run: tools and environments (`rl.tools`, `rl.environment_factory`), as TRL takes them.

A tool is a Python function named `module:function`; its JSON schema (offered to the model through the chat
template's `tools`) is transformers' `get_json_schema` of its signature and docstring, so every argument needs a
type hint and a line in the docstring's `Args:`. An environment is state that lives across an episode's turns:
`rl.environment_factory` names a callable returning a fresh instance per episode, with

    reset(**row) -> str | None     the prompt's row (its columns); text returned is appended to the last user
                                   message (the same text for every episode of a prompt: they share it)
    <public methods>               the episode's tools, beside rl.tools (documented as tools are)
    get_reward() -> float          optional: the episode's reward from the environment's state, a reward named
                                   after the class (weight 1)
    close()                        optional: called when the episode ends, whatever ended it

Calls run in threads (`run_calls`): a turn's calls, and those of every episode ending a turn at the same step, at
once, each given `rl.tool_timeout` seconds. Whatever goes wrong in a call becomes the text the model reads as its
result, and is counted: an unknown tool, arguments that are not an object or that the function does not take, an
exception, a result that is not text (numbers are written as JSON writes them, dicts and lists as JSON), a call
past its timeout (its thread is left to finish on its own: a daemon, it cannot keep the run from ending).
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from finetune.errors import FinetuneError, first_line, imported
from finetune.rollouts.tool_calls import Call

ENVIRONMENT_METHODS = ("reset", "get_reward", "close")
"""An environment's methods that are not tools."""


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]


def tool_of(function: Callable[..., Any], setting: str) -> Tool:
    """A function as a tool, its schema from its signature and docstring (one line naming the fix if it has none)."""
    try:
        schema = get_json_schema(function)
    except Exception as exc:  # transformers' own: a missing docstring, an argument without a type or description
        raise FinetuneError(
            f"{setting}: {getattr(function, '__name__', function)} has no JSON schema ({first_line(exc)}); give every "
            "argument a type hint and a line in the docstring's Args: section (transformers' get_json_schema)"
        ) from None
    schema.get("function", {}).pop("return", None)  # what templates render: the arguments
    return Tool(schema["function"]["name"], function, schema)


def load_tools(names: list[str]) -> list[Tool]:
    """`rl.tools`: each function imported and given its schema; two of one name refused."""
    tools = [tool_of(imported(name, "rl.tools", "a function"), f"rl.tools {name}") for name in names]
    _check_unique(tools, "rl.tools")
    return tools


def _check_unique(tools: list[Tool], where: str) -> None:
    names = [tool.name for tool in tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise FinetuneError(f"{where}: two tools are named {', '.join(twice)}; the model calls a tool by its name")


@dataclass
class EnvironmentFactory:
    """`rl.environment_factory`: what builds an episode's environment, and what its instances offer."""

    name: str
    factory: Callable[[], Any]
    kind: type
    rewarded: bool
    """Its instances give a reward (`get_reward`)."""
    methods: tuple[Tool, ...] = ()
    """Its tools as one instance offered them: their schemas are every instance's (read once, at load)."""

    @staticmethod
    def load(name: str, tools: list[Tool]) -> EnvironmentFactory:
        """The factory imported, one instance built to read its tools (checked as rl.tools are)."""
        factory = imported(name, "rl.environment_factory", "a callable returning an environment")
        found = EnvironmentFactory(name, factory, object, False)
        instance = found._built()
        if not callable(getattr(instance, "reset", None)):
            raise FinetuneError(
                f"rl.environment_factory={name} returned a {type(instance).__name__}, which has no reset method; an "
                "environment defines reset(**row) -> str | None (and its tools as public methods)"
            )
        where = f"rl.environment_factory={name}: the method"
        methods = tuple(
            tool_of(getattr(instance, n), where) for n, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not n.startswith("_") and n not in ENVIRONMENT_METHODS
        )  # fmt: skip
        _check_unique(tools + list(methods), f"rl.tools and {name}'s methods")
        close_environments([instance])
        rewarded = callable(getattr(instance, "get_reward", None))
        return EnvironmentFactory(name, factory, type(instance), rewarded, methods)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """Its methods' schemas (the same for every instance)."""
        return [method.schema for method in self.methods]

    def _built(self) -> Any:
        try:
            return self.factory()
        except Exception as exc:
            raise FinetuneError(
                f"rl.environment_factory={self.name} raised {type(exc).__name__}: {first_line(exc)}; it is called "
                "with no arguments, once per episode"
            ) from None

    def started(self, row: dict[str, Any]) -> tuple[Any, str | None]:
        """A new instance reset with a prompt's row, and the text it returned."""
        instance = self._built()
        try:
            text = instance.reset(**row)
        except Exception as exc:
            close_environments([instance])
            raise FinetuneError(
                f"rl.environment_factory={self.name}: reset raised {type(exc).__name__}: {first_line(exc)} (given "
                f"the prompt's row, columns {', '.join(row)})"
            ) from None
        if text is not None and not isinstance(text, str):
            close_environments([instance])
            raise FinetuneError(
                f"rl.environment_factory={self.name}: reset returned {type(text).__name__}; return text (appended to "
                "the prompt's last user message) or None"
            )
        return instance, text

    def tools(self, instance: Any) -> list[Tool]:
        """An instance's methods as tools (bound to it; their schemas the ones read at load)."""
        return [Tool(method.name, getattr(instance, method.name), method.schema) for method in self.methods]


def close_environments(instances: list[Any]) -> None:
    """Each environment's `close`, where it has one (called whatever ended the episode); one that raises does not
    keep the others open, and its error is said once all are closed."""
    failed = None
    for instance in instances:
        close = getattr(instance, "close", None)
        try:
            if callable(close):
                close()
        except Exception as exc:
            failed = failed or f"{type(instance).__name__}.close raised {type(exc).__name__}: {first_line(exc)}"
    if failed:
        raise FinetuneError(f"rl.environment_factory: {failed}; fix the environment (close ends every episode)")


@dataclass
class Outcome:
    """A call's result as the model reads it, and what went wrong (None: nothing)."""

    text: str
    error: str | None = None
    """`error` (the tool raised, or its arguments or result were wrong), `unknown` (no such tool), `timeout`."""


def run_calls(batches: list[tuple[list[Call], dict[str, Tool], float]]) -> list[tuple[list[Outcome], float]]:
    """Each turn's calls (with the tools its episode may call, and the seconds each may take) run at once in
    threads; their outcomes, turn by turn in order, and the seconds the turn's calls took (its slowest)."""
    began = time.monotonic()
    started = [[_started(call, tools, timeout) for call in calls] for calls, tools, timeout in batches]
    turns = []
    for runs, (calls, _, timeout) in zip(started, batches, strict=True):
        outcomes = [_finished(run, call, began + timeout, timeout) for run, call in zip(runs, calls, strict=True)]
        took = max([min(run.took, timeout) for run in runs if run.thread is not None], default=0.0)
        turns.append((outcomes, took))
    return turns


@dataclass
class _Run:
    thread: threading.Thread | None
    outcome: list[Outcome]
    began: float = 0.0
    ended: list[float] = field(default_factory=list)

    @property
    def took(self) -> float:
        """Seconds the call ran (infinite while it runs: past its deadline, it took all it was given)."""
        return self.ended[0] - self.began if self.ended else float("inf")


def _started(call: Call, tools: dict[str, Tool], timeout: float) -> _Run:
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return _Run(None, [Outcome(f"Error: there is no tool named {call.name!r} (the tools: {known})", "unknown")])
    if call.arguments is None:
        return _Run(None, [Outcome(f"Error: the call of {call.name} could not be read: {call.problem}", "error")])
    if timeout <= 0:
        spent = f"Error: {call.name} was not run: the episode's time for tools is spent"
        return _Run(None, [Outcome(spent, "timeout")])
    run = _Run(None, [], time.monotonic())
    run.thread = threading.Thread(target=_call, args=(tool, call.arguments, run), daemon=True)
    run.thread.start()
    return run


def _call(tool: Tool, arguments: dict[str, Any], run: _Run) -> None:
    try:
        value = tool.function(**arguments)
    except Exception as exc:
        run.outcome.append(Outcome(f"Error: {type(exc).__name__}: {first_line(exc)}", "error"))
    else:
        run.outcome.append(_as_text(value, tool.name))
    run.ended.append(time.monotonic())


def _as_text(value: Any, name: str) -> Outcome:
    """A tool's result as the text the model reads: text as it is, numbers, lists and dicts as JSON."""
    if isinstance(value, str):
        return Outcome(value)
    if isinstance(value, (bool, int, float, list, dict)):
        try:
            return Outcome(json.dumps(value, ensure_ascii=False))
        except (TypeError, ValueError):
            pass
    return Outcome(f"Error: {name} returned {type(value).__name__}, not text", "error")


def _finished(run: _Run, call: Call, deadline: float, timeout: float) -> Outcome:
    if run.thread is not None:
        run.thread.join(max(0.0, deadline - time.monotonic()))
    if run.outcome:
        return run.outcome[0]
    return Outcome(f"Error: {call.name} did not answer within {timeout:g} seconds", "timeout")
