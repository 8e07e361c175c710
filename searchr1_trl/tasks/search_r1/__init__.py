"""The Search-R1 task with native tool calls (the default): the question stream, ``search`` as a function tool the
chat template renders (``env``), exact match of the last assistant message, and scripted warm-start traces
(``warm_start``). A new tool-calling task is another folder like this one (``docs/adding_a_task.md``)."""

from searchr1_trl.tasks import Task
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.rubric import final_answer
from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory
from searchr1_trl.tasks.search_r1.warm_start import warm_start_traces

TASK = Task(name="search_r1", sample=SearchR1Sample, envs=SearchR1EnvFactory, answer=final_answer,
            methods=("direct", "rag", "agent"), needs_retriever=True, warm_start=warm_start_traces)
