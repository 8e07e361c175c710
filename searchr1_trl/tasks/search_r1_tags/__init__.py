"""The Search-R1 paper's own protocol: reasoning, searches and the answer in tags of one text (``env``), on the same
question stream, search tool and exact-match rubric as the tool-call task; EM on the final ``<answer>``."""

from searchr1_trl.tasks import Task
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.search_r1_tags.env import SearchR1TagEnvFactory, tag_answer

TASK = Task(name="search_r1_tags", sample=SearchR1Sample, envs=SearchR1TagEnvFactory, answer=tag_answer,
            methods=("direct", "rag", "agent"), needs_retriever=True)
