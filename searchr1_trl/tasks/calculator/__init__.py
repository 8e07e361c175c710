"""Arithmetic with a calculator tool, the worked example of ``docs/adding_a_task.md``: a tool-calling task in one
small file (``env``), on the question stream and exact-match rubric every task shares."""

from searchr1_trl.tasks import Task
from searchr1_trl.tasks.calculator.env import CalculatorEnvFactory
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.rubric import final_answer

TASK = Task(name="calculator", sample=SearchR1Sample, envs=CalculatorEnvFactory, answer=final_answer,
            methods=("direct", "agent"), needs_retriever=False)
