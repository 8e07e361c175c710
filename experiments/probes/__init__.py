"""Research probes: one-off measurements behind a design choice (where passages go, CPU dtype and memory of vLLM,
greedy answers before and after training, LoRA sync memory, the retriever encoder's forwards on CPU), kept so the
choice can be re-checked. The benchmarks, which track what users run, are one level up."""
