"""The question stream: an endless, reproducible, resumable sequence of questions, what every task here reads.

Rows come from a parquet with ``question`` and ``golden_answers`` columns (and optionally ``data_source``): the
preprocessed NQ/HotpotQA files on the Hub dataset ``PeterJinGo/nq_hotpotqa_train`` by default, or a local file via
``data_path``. The stream never ends: with ``shuffle`` (the default) every epoch is a fresh permutation drawn from a
numpy Generator seeded by ``seed``, so each wrap shows the rows in a new order and each row exactly once per epoch;
with ``shuffle=False`` every epoch is file order, so validation draws the same samples every time.
``state_dict()`` captures the generator state, the current epoch's order and the cursor, so a resumed run yields
exactly the samples the uninterrupted run would have.

:class:`QuestionBatches` is the trainer's dataloader over the stream: TRL's generation-batch layout, drawn one
optimizer step at a time, so the stream's position is the number of steps taken and a checkpoint of it resumes there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import huggingface_hub
import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from trl import GRPOConfig

    from searchr1_trl.engine.rollout import EnvFactory

REQUIRED_COLUMNS = ("question", "golden_answers")


@dataclass(frozen=True)
class SearchR1Sample:
    """One question; a prediction is correct when it matches any of ``golden_answers`` after normalisation."""

    question: str
    golden_answers: tuple[str, ...]
    data_source: str | None = None

    def as_row(self) -> dict:
        """The sample as the columns of a training row (what TRL's ``environment_factory`` gets as ``reset(**row)``)."""
        return {"question": self.question, "golden_answers": list(self.golden_answers), "data_source": self.data_source}

    @classmethod
    def from_row(cls, row: dict) -> SearchR1Sample:
        """The sample a training row was built from (:meth:`as_row`); other columns are ignored."""
        return cls(row["question"], tuple(row["golden_answers"]), row["data_source"])


@dataclass
class SearchR1DatasetConfig:
    filename: str = field(
        default="train.parquet",
        metadata={"help": "Parquet file inside `repo_id` to load: `train.parquet` (training) or `test.parquet`."},
    )
    repo_id: str = field(
        default="PeterJinGo/nq_hotpotqa_train",
        metadata={"help": "Hugging Face Hub dataset repository holding the preprocessed NQ/HotpotQA parquet files."},
    )
    data_path: str | None = field(
        default=None,
        metadata={"help": "Local parquet file; when set it replaces the Hub download. Needs `question` and "
                          "`golden_answers` columns."},
    )
    seed: int = field(default=42, metadata={"help": "Seed of the row shuffle (a fresh permutation every epoch)."})
    data_source: str | None = field(
        default=None,
        metadata={"help": "Keep only rows whose `data_source` equals this (e.g. `nq`); None keeps every row."},
    )
    shuffle: bool = field(
        default=True,
        metadata={"help": "Shuffle rows with `seed`, reshuffling on every wrap. False keeps file order, so "
                          "validation draws the same samples every time."},
    )


def _golden_answers(value: Any, row: int, path: str) -> tuple[str, ...]:
    """The golden answers of one row as a tuple of strings.

    Hub files store a list or numpy array of strings, some files a single string:
    ``np.array(["Paris", "City of Light"])`` -> ``("Paris", "City of Light")``; ``"Paris"`` -> ``("Paris",)``.
    """
    answers = (value,) if isinstance(value, str) else value
    if not isinstance(answers, (list, tuple, np.ndarray)) or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{path}: row {row}: golden_answers must be a string or a list of strings, got {value!r}")
    if len(answers) == 0:
        raise ValueError(f"{path}: row {row}: golden_answers is empty; every question needs at least one answer")
    if not all(a.strip() for a in answers):
        raise ValueError(f"{path}: row {row}: golden_answers holds an empty answer ({list(answers)!r}); expected "
                         "non-empty strings (no answer can ever match an empty one)")
    return tuple(answers)


def load_samples(path: str, data_source: str | None = None) -> list[SearchR1Sample]:
    """Every row of the parquet at ``path`` (only those of ``data_source`` when given), in file order."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file (expected a parquet with columns {', '.join(REQUIRED_COLUMNS)})")
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{path}: not a readable parquet file: {error}") from error
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; found {', '.join(map(str, frame.columns))}")
    has_source = "data_source" in frame.columns
    if frame.empty:
        raise ValueError(f"{path}: the file has no rows")
    if has_source and frame["data_source"].isna().any():  # NaN among strings: Arrow refuses the column later
        unset = frame.index[frame["data_source"].isna()].tolist()
        shown = ", ".join(map(str, unset[:5])) + (", ..." if len(unset) > 5 else "")
        raise ValueError(f"{path}: {len(unset)} of {len(frame)} rows have no data_source (row {shown}); fill the "
                         "column (e.g. with the dataset's name) or drop it")
    if data_source is not None:
        if not has_source:
            raise ValueError(f"{path}: data_source={data_source!r} asked for but the file has no data_source column")
        found = sorted(map(str, frame["data_source"].unique()))
        frame = frame[frame["data_source"] == data_source]
        if frame.empty:
            raise ValueError(f"{path}: empty after filtering: no row has data_source={data_source!r} (found {found})")
    sources = frame["data_source"] if has_source else [None] * len(frame)
    samples = []
    rows = zip(frame.index, frame["question"], frame["golden_answers"], sources, strict=True)
    for row, question, answers, source in rows:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{path}: row {row}: question must be a non-empty string, got {question!r}")
        samples.append(SearchR1Sample(question, _golden_answers(answers, row, path), source))
    return samples


class SearchR1Dataset(Iterator[SearchR1Sample]):
    """Endless iterator of :class:`SearchR1Sample`; see the module docstring for order and resume semantics."""

    def __init__(self, config: SearchR1DatasetConfig | None = None):
        self.config = config or SearchR1DatasetConfig()
        self.path = self._resolve_path()
        self.samples = load_samples(self.path, self.config.data_source)
        self._rng = np.random.default_rng(self.config.seed)
        self._epoch = 0
        self._order = self._draw_order(self._rng)
        self._cursor = 0

    def _resolve_path(self) -> str:
        """The local parquet: ``data_path`` as given, else the Hub file (downloaded once, then from the cache)."""
        if self.config.data_path is not None:
            return self.config.data_path
        return huggingface_hub.hf_hub_download(self.config.repo_id, self.config.filename, repo_type="dataset")

    def _draw_order(self, rng: np.random.Generator) -> list[int]:
        """The row order of the epoch about to start; draws from ``rng`` only when shuffling."""
        if self.config.shuffle:
            return rng.permutation(len(self.samples)).tolist()
        return list(range(len(self.samples)))

    def __len__(self) -> int:
        """Distinct samples (one epoch), not the length of the endless stream."""
        return len(self.samples)

    def __next__(self) -> SearchR1Sample:
        if self._cursor == len(self._order):
            self._epoch += 1
            self._order = self._draw_order(self._rng)
            self._cursor = 0
        sample = self.samples[self._order[self._cursor]]
        self._cursor += 1
        return sample

    def take(self, n: int) -> list[SearchR1Sample]:
        """The first ``n`` samples a freshly built stream yields, at most one epoch of them; this stream does not move.

        A fixed slice for validation: with ``shuffle=False`` it is the first ``n`` rows of the file, with
        ``shuffle=True`` the start of the ``seed``'s first permutation, and it is the same on every call.
        """
        order = self._draw_order(np.random.default_rng(self.config.seed))
        return [self.samples[i] for i in order[:n]]

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands, as plain ints and lists (JSON- and pickle-safe)."""
        return {
            "num_samples": len(self.samples),
            "epoch": self._epoch,
            "cursor": self._cursor,
            "order": list(self._order),
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the stream that produced ``state`` stood."""
        if state["num_samples"] != len(self.samples):
            raise ValueError(
                f"{self.path}: the saved stream state is for {state['num_samples']} samples, this dataset has "
                f"{len(self.samples)} (different file or data_source?)"
            )
        self._epoch = state["epoch"]
        self._cursor = state["cursor"]
        self._order = list(state["order"])
        self._rng.bit_generator.state = state["rng"]


def training_row(sample: SearchR1Sample, envs: EnvFactory) -> dict:
    """A training row: the sample's columns, and the prompt its env starts from (TRL requires one per row)."""
    return {"prompt": envs().reset(sample), **sample.as_row()}


class QuestionBatches:
    """The training dataloader: generation batches drawn from the question stream, one draw per optimizer step.

    Reproduces TRL's ``RepeatSampler`` layout (each question ``num_generations`` times in a row, the same global
    batch repeated ``steps_per_generation * num_iterations`` times, each process taking its contiguous slice),
    but from a stream whose position is exactly the number of optimizer steps taken, so it can be checkpointed.
    """

    def __init__(self, stream: SearchR1Dataset, envs: EnvFactory, args: GRPOConfig, process_index: int,
                 num_processes: int):
        self.stream, self.envs = stream, envs
        self.questions_per_step = args.generation_batch_size // args.num_generations
        self.num_generations = args.num_generations
        self.repeats = args.steps_per_generation * args.num_iterations
        self.process_index, self.num_processes = process_index, num_processes
        self.source = self.draw  # where each step's rows come from (async_rollouts draws them ahead)

    def draw(self) -> list[dict]:
        """This process's rows of the next optimizer step."""
        samples = [next(self.stream) for _ in range(self.questions_per_step)]
        rows = [training_row(s, self.envs) for s in samples for _ in range(self.num_generations)]
        per_process = len(rows) // self.num_processes
        return rows[self.process_index * per_process:(self.process_index + 1) * per_process]

    def __iter__(self):
        while True:
            local = self.source()
            for _ in range(self.repeats):
                yield local
