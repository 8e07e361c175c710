"""The suite's fixtures for the notebook's tests: the same real parts as tests/, imported from tests/conftest.py
(with the hook that marks every test needing a server ``slow``). In a run of both folders the session fixtures
start once per folder."""

from tests.conftest import (  # noqa: F401 - fixtures and a collection hook, registered by being names here
    offline_assets,
    pytest_collection_modifyitems,
    questions_file,
    retriever_server,
    retriever_url,
    squad_dev_sample,
    tiny_model_dir,
    tokenizer,
)
