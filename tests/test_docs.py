"""The docs a user reads first: the README stays a short product page, and every metric the trainer logs is named
and explained in docs/how_it_works.md (read from the code, so a new metric fails here until it is documented)."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
HOW_IT_WORKS = (ROOT / "docs" / "how_it_works.md").read_text()

# Where metrics are logged: the trainer and its parts, the engine, the tasks (their env and retrieval counters).
LOGGING_FOLDERS = ("training", "engine", "tasks")


def commands(markdown: str) -> list[str]:
    """The command lines of ``markdown``'s code blocks, a line continued by a trailing backslash joined to it and
    comment-only lines left out."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", markdown, re.M | re.S)
    lines = re.sub(r"\s*\\\n\s*", " ", "".join(blocks)).splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def prose_sentences(markdown: str) -> list[str]:
    """The sentences of ``markdown`` outside code blocks, tables and headings."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    text = "\n".join(line for line in text.splitlines() if not line.startswith(("|", "#", "!")))
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def test_the_readme_is_a_product_page_of_at_most_150_lines_and_10_commands():
    assert len(README.splitlines()) <= 150
    found = commands(README)
    assert 3 <= len(found) <= 10, found
    assert any(command.startswith("pip install") for command in found)


def test_the_readme_names_no_commit_and_runs_no_benchmark():
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", README)
    assert hashes == []
    assert [c for c in commands(README) if re.search(r"\b(benchmarks|experiments)\b", c)] == []


def test_the_readme_speaks_in_short_sentences():
    words = [len(sentence.split()) for sentence in prose_sentences(README)]
    assert sum(words) / len(words) <= 20, f"{sum(words) / len(words):.1f} words a sentence"


def test_the_command_counter_joins_continued_lines_and_skips_comments():
    text = "```bash\n# set up\npip install x \\\n    --no-deps\nrun a   # trailing\n```\nnot code\n"
    assert commands(text) == ["pip install x --no-deps", "run a   # trailing"]


def _key(node: ast.expr) -> str | None:
    """A metric key as a regular expression: a string literal as itself, an f-string with ``.+`` for each value
    (``f"rollout/status_{status.value}"`` -> ``rollout/status_.+``); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(part.value) if isinstance(part, ast.Constant) else ".+" for part in node.values)
    return None


def _is_metric_store(node: ast.expr) -> bool:
    """``metrics``, ``self.metrics`` or ``self._metrics[mode]``: what a metric key subscripts (``self._metrics``
    alone is subscripted by the mode, ``train`` or ``eval``)."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Attribute) and node.value.attr == "_metrics"
    return (isinstance(node, ast.Name) and node.id == "metrics") or (isinstance(node, ast.Attribute)
                                                                      and node.attr == "metrics")


def logged_metric_keys() -> set[str]:
    """Every metric key the package's training, engine and task code logs, as regular expressions: keys subscripting a
    metric store, and the keys of the dicts a ``metrics()`` method returns. The keys of evaluation's ``summarize`` are
    logged once per sample, ``eval_<key>`` and ``report_<key>``: they come back as ``eval_<key>``."""
    keys = set()
    sources = [p for folder in LOGGING_FOLDERS for p in (ROOT / "searchr1_trl" / folder).rglob("*.py")]
    for path in sources:
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            prefix = "eval_" if function.name == "summarize" else ""
            found = [node.slice for node in ast.walk(function)
                     if isinstance(node, ast.Subscript) and _is_metric_store(node.value)]
            if function.name in ("metrics", "summarize"):
                for node in ast.walk(function):
                    found += [k for k in node.keys if k] if isinstance(node, ast.Dict) else []
                    found += [node.key] if isinstance(node, ast.DictComp) else []
            keys |= {prefix + key for key in map(_key, found) if key is not None}
    return keys


def documented_names() -> set[str]:
    """The names in backticks of docs/how_it_works.md's metric tables (their first column)."""
    return set(re.findall(r"^\| `([^`]+)` \|", HOW_IT_WORKS, re.M))


def test_every_metric_the_trainer_logs_is_named_in_how_it_works():
    keys = logged_metric_keys()
    # the collection reads each kind of key: plain, an f-string, a counter dict's, a validation summary's
    assert {"rollout/searches_per_rollout", "rollout/status_.+", "search/failures", "eval_em", "eval_status_.+",
            "async/behaviour_kl", "train/skipped_nonfinite_step", "weight_sync/time_s"} <= keys
    names = documented_names()
    undocumented = sorted(key for key in keys if not any(re.fullmatch(key, name) for name in names))
    assert undocumented == []


def test_the_metric_tables_name_each_metric_once():
    rows = re.findall(r"^\| `([^`]+)` \|", HOW_IT_WORKS, re.M)
    assert len(rows) == len(set(rows)) > 40


def test_recipe_comments_carry_no_dates_and_say_why_in_one_line():
    for recipe in sorted((ROOT / "configs").glob("*.yaml")):
        lines = recipe.read_text().splitlines()
        assert not re.search(r"\b20\d\d-\d\d", "\n".join(lines)), recipe.name
        body = lines[next(i for i, line in enumerate(lines) if not line.startswith("#")):]  # after the header
        assert [line for line in body if re.match(r"\s+#", line)] == [], recipe.name  # no comment continued
        assert not any(a.startswith("#") and b.startswith("#") for a, b in itertools.pairwise(body)), recipe.name


def test_every_module_how_it_works_names_exists():
    # the data flow's map goes stale silently when a module moves: each path it names is in the package or the repo
    named = set(re.findall(r"`((?:assets|serving|engine|tasks|training|cli|retriever_server)/[a-z0-9_/]*(?:\.py)?)`",
                           HOW_IT_WORKS))
    assert {"engine/rollout.py", "training/trainer.py", "retriever_server/"} <= named
    missing = sorted(p for p in named if not ((ROOT / "searchr1_trl" / p).exists() or (ROOT / p).exists()))
    assert missing == []
