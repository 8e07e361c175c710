"""Training: the recipe (``recipe``) and its checks (``plan``), the TRL trainer (``trainer``) with its policy
update levers (``update``), guards (``callbacks``), supervised warm start (``warm_start``) and validation
(``evaluation``). Features not yet shown to win and be stable live in ``experimental``."""
