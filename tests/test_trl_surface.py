"""The private TRL and transformers surface SearchR1Trainer relies on, listed in ``searchr1_trl/training/trainer.py``'s
docstring, is there: a TRL upgrade that moves it fails here by name, not as an AttributeError mid-training."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import transformers
import trl

from searchr1_trl.training import trainer

ROOT = Path(__file__).resolve().parent.parent


def pinned(package: str) -> str:
    """The version ``requirements-lock.txt`` pins ``package`` at."""
    lock = (ROOT / "requirements-lock.txt").read_text()
    found = re.search(rf"^{package}==(\S+)", lock, re.MULTILINE)
    assert found, f"requirements-lock.txt pins no {package}"
    return found.group(1)


def surface() -> list[str]:
    """The dotted names of the docstring's list: ``- ``trl.GRPOTrainer._generate``: ...`` -> that name."""
    return re.findall(r"^- ``((?:trl|transformers)\.[\w.]+)``:", trainer.__doc__, re.MULTILINE)


def exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module attribute, a class attribute or an attribute the class's ``__init__`` sets."""
    module_name, _, rest = dotted.partition(".")
    owner = importlib.import_module(module_name)
    for part in rest.split("."):
        if hasattr(owner, part):
            owner = getattr(owner, part)
        elif inspect.isclass(owner):
            return re.search(rf"\bself\.{part}\s*=", inspect.getsource(owner.__init__)) is not None
        else:
            return False
    return True


@pytest.mark.parametrize("package, module", [("trl", trl), ("transformers", transformers)])
def test_the_installed_version_is_the_pinned_one(package, module):
    assert module.__version__ == pinned(package), (
        f"{package} {module.__version__} is installed but requirements-lock.txt pins {pinned(package)}: "
        f"SearchR1Trainer relies on private {package} methods and attributes "
        f"(searchr1_trl/training/trainer.py's docstring lists them); check each against {module.__version__}, then "
        "move the pin and the docstring")


def test_the_docstring_names_the_pinned_versions():
    assert f"TRL {pinned('trl')} and transformers {pinned('transformers')}" in trainer.__doc__


def test_the_list_names_every_private_method_the_trainer_overrides():
    overridden = {name for name, value in vars(trainer.SearchR1Trainer).items()
                  if name.startswith("_") and not name.startswith("__") and callable(value)
                  and any(hasattr(base, name) for base in trainer.SearchR1Trainer.__mro__[1:])}
    assert overridden == {"_compute_loss", "_get_per_token_logps_and_entropies", "_generate",
                          "_generate_and_score_completions", "_save_checkpoint"}
    assert overridden - {name.rsplit(".", 1)[1] for name in surface()} == set()


@pytest.mark.parametrize("dotted", surface())
def test_every_private_entry_the_trainer_relies_on_exists(dotted):
    assert exists(dotted), (f"{dotted} is gone from the installed {dotted.split('.')[0]}; SearchR1Trainer uses it "
                            "(searchr1_trl/training/trainer.py's docstring says how): port that use, then update "
                            "the list")
