"""Text -> unit vectors, the one piece the index builder and the server must agree on.

Defaults follow the model family named by ``retriever_name`` (or, when it is not given, by the model's own name):
e5 models get mean pooling and the ``query: `` / ``passage: `` prefixes they were trained with, bge models get CLS
pooling, everything else (the offline MiniLM included) mean pooling and no prefix. Embeddings are L2-normalised so
that the index's inner product is cosine similarity. fp16 is used only on GPU, where it halves memory and doubles
throughput; CPU kernels for fp16 are slow, so CPU stays fp32.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

POOLINGS = ("mean", "cls")

# Encoded at build time and at every server start: an encoder that embeds it differently (other weights, pooling
# or prefix under the same width) would make every query search an index of vectors it did not write.
PROBE_PASSAGE = "Paris\nParis is the capital and largest city of France, on the river Seine."


@dataclass
class EncoderConfig:
    """The embedding model and how its outputs become vectors; stored beside the index so the server can check it."""

    retriever_model: str = field(
        metadata={"help": "Folder or Hub name of the embedding model (e.g. intfloat/e5-base-v2; the offline "
                          "all-MiniLM-L6-v2 is the `embedder` path `searchr1-assets` prints)."},
    )
    retriever_name: str | None = field(
        default=None,
        metadata={"help": "Model family (e5, bge, ...) choosing pooling and prefix defaults; default: model name."},
    )
    pooling: str | None = field(default=None, metadata={"help": "mean or cls; default: cls for bge, mean otherwise."})
    normalize: bool = field(default=True, metadata={"help": "L2-normalise embeddings (inner product = cosine)."})
    query_prefix: str | None = field(default=None, metadata={"help": "Prepended to queries; default 'query: ' for e5."})
    passage_prefix: str | None = field(
        default=None, metadata={"help": "Prepended to passages; default 'passage: ' for e5."}
    )
    max_length: int = field(default=256, metadata={"help": "Tokens kept per text; longer texts are truncated."})
    encode_batch_size: int | None = field(
        default=None,
        metadata={"help": "Texts per forward pass. Default: 128 on CPU, 512 on GPU, where a forward of a few hundred "
                          "queries costs about its kernel launches (6.8 ms for 64 queries on an H200)."},
    )
    max_forward_chars: int | None = field(
        default=None,
        metadata={"help": "Most characters (padded to the longest text) in one forward pass. Default: 4,096 on CPU, "
                          "where big forwards are slow (2 cores: 114 passages in 3.2 s against 6.5 s in one forward, "
                          "256 questions in 0.71 s against 1.03 s), unbounded on GPU."},
    )
    fp16: bool = field(default=True, metadata={"help": "Run the model in fp16 when on GPU (ignored on CPU)."})
    device: str | None = field(default=None, metadata={"help": "torch device; default cuda if available, else cpu."})

    def __post_init__(self) -> None:
        family = (self.retriever_name or Path(self.retriever_model.rstrip("/")).name).lower()
        is_e5 = "e5" in family
        if self.pooling is None:
            self.pooling = "cls" if "bge" in family else "mean"
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.query_prefix is None:
            self.query_prefix = "query: " if is_e5 else ""
        if self.passage_prefix is None:
            self.passage_prefix = "passage: " if is_e5 else ""
        if self.max_length <= 0 or any(v is not None and v <= 0 for v in (self.encode_batch_size,
                                                                            self.max_forward_chars)):
            raise ValueError(
                "max_length, encode_batch_size and max_forward_chars must be positive, got "
                f"{self.max_length}, {self.encode_batch_size}, {self.max_forward_chars}"
            )

    def fingerprint(self) -> dict:
        """The fields that change the vectors; an index is only valid for queries encoded with the same ones."""
        keys = ("retriever_model", "pooling", "normalize", "query_prefix", "passage_prefix", "max_length")
        return {k: v for k, v in asdict(self).items() if k in keys}


def forward_groups(lengths: list[int], batch_size: int, max_chars: int | None = None) -> list[np.ndarray]:
    """The indices of texts of these ``lengths`` split into forward passes: longest first, at most ``batch_size`` a
    pass, and a text joins a pass only while the pass padded to its longest text stays within twice the texts' own
    lengths and within ``max_chars``. A forward pads every text to the longest: 4 queries of 256 tokens beside 60
    short ones took a 64-query batch from 0.13 s to 2.26 s (MiniLM, 2 cores), and every request in that batch waited
    for it."""
    order = np.argsort([-n for n in lengths], kind="stable")
    groups: list[list[int]] = []
    longest = total = 0
    for i in order:
        n = max(lengths[i], 1)
        padded = (len(groups[-1]) + 1) * longest if groups else 0  # the pass's characters with this text in it
        if (groups and len(groups[-1]) < batch_size and padded <= 2 * (total + n)
                and (max_chars is None or padded <= max_chars)):
            groups[-1].append(int(i))
            total += n
        else:
            groups.append([int(i)])
            longest = total = n
    return [np.array(g) for g in groups]


class Encoder:
    """A Hugging Face encoder with configurable pooling; ``encode_queries``/``encode_passages`` give float32 arrays."""

    def __init__(self, config: EncoderConfig):
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(config.retriever_model)
        gpu = self.device.type == "cuda"
        self.batch_size = config.encode_batch_size or (512 if gpu else 128)
        self.max_forward_chars = config.max_forward_chars or (None if gpu else 4096)
        dtype = torch.float16 if config.fp16 and gpu else torch.float32
        self.model = AutoModel.from_pretrained(config.retriever_model, dtype=dtype).to(self.device).eval()
        self.dim = self.model.config.hidden_size
        # The tokenizers library's own tokenizer, truncating and padding as the call in ``_tokenize`` would.
        self._backend = None
        if self.tokenizer.is_fast:
            self._backend = copy.deepcopy(self.tokenizer.backend_tokenizer)
            self._backend.enable_truncation(config.max_length)
            self._backend.enable_padding(pad_id=self.tokenizer.pad_token_id, pad_token=self.tokenizer.pad_token,
                                         direction=self.tokenizer.padding_side)

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        return self._encode([self.config.query_prefix + q for q in queries])

    def encode_passages(self, passages: list[str]) -> np.ndarray:
        return self._encode([self.config.passage_prefix + p for p in passages])

    def probe_vector(self) -> list[float]:
        """The embedding of :data:`PROBE_PASSAGE`: a fingerprint of what the encoder computes, weights included."""
        return [round(float(x), 6) for x in self.encode_passages([PROBE_PASSAGE])[0]]

    @torch.inference_mode()
    def _encode(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Characters past about four per kept token are truncated away and cost the forward nothing.
        lengths = [min(len(t), 4 * self.config.max_length) for t in texts]
        for rows in forward_groups(lengths, self.batch_size, self.max_forward_chars):
            batch = {k: v.to(self.device) for k, v in self._tokenize([texts[i] for i in rows]).items()}
            hidden = self.model(**batch).last_hidden_state
            if self.config.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                # Padding positions must not dilute the mean, so they are masked out of both sum and count.
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            pooled = pooled.float()
            if self.config.normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[rows] = pooled.cpu().numpy()
        return out

    def _tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The tokenizer's ``(texts, padding=True, truncation=True, return_tensors="pt")``, the same tensors. With a
        fast tokenizer the Rust one is called directly: transformers' call holds the GIL building its BatchEncoding
        (512 queries in batches of 128: 8.6 ms of the calling thread against 3.5 here,
        experiments/retriever_profile.py), time the server's other threads wait for."""
        if self._backend is None:
            return dict(self.tokenizer(texts, padding=True, truncation=True, max_length=self.config.max_length,
                                       return_tensors="pt"))
        encodings = self._backend.encode_batch_fast(texts)
        fields = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
        return {name: torch.from_numpy(np.array([getattr(e, fields[name]) for e in encodings], dtype=np.int64))
                for name in self.tokenizer.model_input_names if name in fields}
