"""Arithmetic with a ``calculator`` tool: the worked example of ``docs/adding_a_task.md``.

A question asks for an arithmetic result ("What is 17 * 23?"); the model may call ``calculator`` with an
``expression`` and answers with the number alone. The tool evaluates + - * / and parentheses on numbers, and nothing
else (:func:`calculate`); what it cannot evaluate gets an error message, counted, never raised.
"""

from __future__ import annotations

import ast
import json
import operator
from collections import Counter

import numpy as np
import pandas as pd

from searchr1_trl.engine.rollout import EnvFactory, EnvStep, MessageEnv

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 12 * (3 + 4).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

INSTRUCTION = "Answer the question. Use the calculator tool for arithmetic; reply with the number only.\n\nQuestion: "

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text (``"12 * (3 + 4)"`` -> ``"84"``, ``"7 / 2"`` -> ``"3.5"``);
    ValueError for anything else (no names, no calls: the model's text is never run)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"{ast.unparse(node)!r} is no arithmetic")
    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError, RecursionError) as error:
        raise ValueError(str(error)) from None
    return str(int(result)) if float(result).is_integer() else str(result)


class CalculatorEnv(MessageEnv):
    """One rollout: the question as the prompt; each calculator call answered with its value."""

    def __init__(self, factory: CalculatorEnvFactory):
        self.factory = factory

    def reset(self, sample) -> list[dict]:
        return [{"role": "user", "content": INSTRUCTION + sample.question}]

    async def step(self, messages: list[dict]) -> EnvStep:
        calls = messages[-1].get("tool_calls") or []
        return EnvStep(messages=[self.factory.answer(call) for call in calls], done=not calls)


class CalculatorEnvFactory(EnvFactory):
    """A :class:`CalculatorEnv` per rollout; counts the calls it could not evaluate."""

    def __init__(self, config=None):  # the recipe's env knobs are the search tasks'; a calculator has none
        self.tools = [CALCULATOR_TOOL]
        self._counts: Counter[str] = Counter()

    def __call__(self) -> CalculatorEnv:
        return CalculatorEnv(self)

    def answer(self, call: dict) -> dict:
        """The tool message answering one call: the value, or an error naming what was wrong."""
        arguments = (call.get("function") or {}).get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            content = calculate(str(arguments["expression"]))
        except (ValueError, TypeError, KeyError) as error:  # counted: the model learns the call was wrong
            self._counts["bad_calls"] += 1
            content = f"Error: {error}; expected an arithmetic expression such as 12 * (3 + 4)"
        return {"role": "tool", "name": "calculator", "content": content}

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, Counter()
        return {"calculator/bad_calls": counts["bad_calls"]}


def arithmetic_questions(n: int, seed: int = 0) -> pd.DataFrame:
    """``n`` questions "What is a <op> b?" with their answers, in the question stream's columns (write them with
    ``.to_parquet(path)`` and point ``train_data_path`` / ``eval_data_path`` there)."""
    rng = np.random.default_rng(seed)
    rows = []
    for a, b, op in zip(rng.integers(2, 100, n), rng.integers(2, 100, n), rng.choice(["+", "-", "*"], n), strict=True):
        expression = f"{a} {op} {b}"
        rows.append({"question": f"What is {expression}?", "golden_answers": [calculate(expression)],
                     "data_source": "arithmetic"})
    return pd.DataFrame(rows)
