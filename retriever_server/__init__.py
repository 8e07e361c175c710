"""Search-R1-compatible dense retrieval server: ``build_index`` makes the faiss index, ``server`` serves it."""
