"""The processes beside the trainer: child processes that die with their parent (``processes``), the vLLM generator
server (``vllm_server``) and how new weights reach it (``weight_sync``)."""
