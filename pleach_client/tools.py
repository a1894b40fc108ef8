"""The tool registry, and the built-in ``calculator`` (AST-based, never ``eval``).

A tool is a name, a description, a JSON-schema for its input and a sync or async callable
taking the input dict and returning a string (or anything ``str()`` renders). A tool that
raises becomes an error ``tool_result`` and a ``tool.failed`` event; the turn goes on.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import math
import operator
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shared.errors import ToolError

from .providers.base import ToolSpec

ToolFn = Callable[[dict[str, Any]], Any | Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    input_schema: dict[str, Any]
    fn: ToolFn

    def spec(self) -> ToolSpec:
        return ToolSpec(
            name=self.name, description=self.description, input_schema=self.input_schema
        )

    async def call(self, tool_input: dict[str, Any]) -> str:
        """Run the tool; raises ``ToolError`` with the reason when it fails."""
        try:
            result = self.fn(tool_input)
            if inspect.isawaitable(result):
                result = await result
        except ToolError:
            raise
        except Exception as exc:  # a tool's failure is data for the model, not a crash
            raise ToolError(f"{type(exc).__name__}: {exc}") from exc
        return result if isinstance(result, str) else str(result)


class ToolRegistry:
    """Registered tools by name. ``runtime.tools`` is one of these."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def add(self, name: str, description: str, input_schema: dict[str, Any], fn: ToolFn) -> Tool:
        """Register a callable as a tool and return it."""
        return self.register(Tool(name, description, input_schema, fn))

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def list(self) -> list[Tool]:
        return [self._tools[n] for n in self.names()]

    def specs(self, enabled: Iterable[str]) -> builtins.list[ToolSpec]:
        """Specs of the enabled tools that are registered, in the given order."""
        return [self._tools[n].spec() for n in enabled if n in self._tools]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)


# -- calculator ----------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_FUNCS: dict[str, Callable[..., float]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "log": math.log,
    "exp": math.exp,
    "floor": math.floor,
    "ceil": math.ceil,
}
_CONSTS = {"pi": math.pi, "e": math.e}
_MAX_EXPONENT = 1000
_MAX_LENGTH = 500


def evaluate(expression: str) -> float | int:
    """Evaluate an arithmetic expression safely; raises ``ToolError`` on anything else."""
    if len(expression) > _MAX_LENGTH:
        raise ToolError(f"expression longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from exc
    try:
        result: float | int = _eval(tree.body)
        return result
    except (ZeroDivisionError, OverflowError, ValueError) as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from exc


def _eval(node: ast.expr) -> Any:
    match node:
        case ast.Constant(value=value) if isinstance(value, int | float) and not isinstance(
            value, bool
        ):
            return value
        case ast.Name(id=name) if name in _CONSTS:
            return _CONSTS[name]
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            lhs, rhs = _eval(left), _eval(right)
            if isinstance(op, ast.Pow) and abs(rhs) > _MAX_EXPONENT:
                raise ToolError(f"exponent larger than {_MAX_EXPONENT}")
            return _BINARY[type(op)](lhs, rhs)
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_eval(operand))
        case ast.Call(func=ast.Name(id=fname), args=args, keywords=[]) if fname in _FUNCS:
            return _FUNCS[fname](*(_eval(a) for a in args))
        case _:
            raise ToolError(f"unsupported expression element: {ast.dump(node)[:60]}")


def _calculator(tool_input: dict[str, Any]) -> str:
    expression = tool_input.get("expression")
    if not isinstance(expression, str):
        raise ToolError("calculator needs a string 'expression'")
    return repr(evaluate(expression))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (+ - * / // % **, sqrt, sin, log, pi, e).",
    input_schema={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. '2 * (3 + 4)'"}},
        "required": ["expression"],
    },
    fn=_calculator,
)


def default_registry() -> ToolRegistry:
    """A registry holding the built-in tools."""
    return ToolRegistry([CALCULATOR])
