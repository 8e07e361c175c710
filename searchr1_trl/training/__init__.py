"""Training: the recipe (``recipe``: the flat config; ``knobs``: the parts it configures; ``loading``: read from YAML
and the command line; ``parts``: what it builds) and its checks (``plan``), the TRL trainer (``trainer``) with its
policy update levers (``update``), guards (``callbacks``), checkpoints and resume (``resume``), what it records of its
rollouts (``records``), its model card (``model_card``), supervised warm start (``warm_start``) and validation
(``evaluation``). Features not yet shown to win and be stable live in ``experimental``."""
