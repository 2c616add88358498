"""The attacks as presets of one engine configuration, with the paper's defaults."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from fedsim.ranges import Range

from .closed_form.solvers import SOLVERS
from .engine.job_adam import SCHEDULES
from .engine.masks import MASK_INITS, MASK_MODES
from .engine.objectives import DISTANCES, TERMS, term_weight
from .engine.optimizers import ATTACK_OPTIMIZERS

REPLAY_ORDERS = ("known", "unknown")
# The attack optimizers' names (engine/optimizers.py: adam, the per-job Adam rows of many jobs in one
# batched optimization; lbfgs, L-BFGS on the images of one job at a time, masks held at their init)
OPTIMIZERS = tuple(ATTACK_OPTIMIZERS)
IMAGE_INITS = ("random", "closed_form")


_POSITIVE_INT = Range(0, low_open=True, integer=True, words="a positive integer")
_POSITIVE = Range(0, low_open=True, words="positive")
_FRACTION = Range(0, 1, low_open=True)
# The numeric settings (AttackConfig's fields) and the numbers each takes; replay_eps_anneal, a
# fraction with a message of its own, is checked beside them.
_NUMBERS: dict[str, Range] = {
    **dict.fromkeys(("max_iterations", "patience", "plateau_patience", "restarts"), _POSITIVE_INT),
    **dict.fromkeys(("lr", "plateau_factor"), _POSITIVE),
    "snap_every": Range(0, integer=True, words="an integer >= 0"),
    **dict.fromkeys(
        ("replay_eps_start", "replay_eps_end"),
        Range(0, low_open=True, optional=True, words="a positive number (or null)"),
    ),
    # every loss term's weight: None (its default) or >= 0
    **dict.fromkeys(("loss_threshold", *TERMS), Range(0, optional=True)),
}


class AttackConfigError(ValueError):
    """An attack configuration with an unknown key or an impossible value."""


@dataclass(frozen=True)
class AttackConfig:
    name: str = "dia"
    masks: str = "learn"  # off: IG (eval); random: IG (train); oracle: WIIG; learn: DIA
    distance: str = "cosine"  # a name in objectives.DISTANCES: cosine (IG) or euclidean (APRIL)
    # Loss-term weights: one field per term in objectives.TERMS (0 or None: the term is off / its default)
    lambda_pos: float = 0.0  # APRIL: weight of the position-embedding cosine term
    # the classifier's input features from the gradient (closed form) as a loss term (B = 1 gradients)
    lambda_features: float = 0.0
    # the dummies' start: random (N(0, 1), the paper's) or closed_form (a solver's answer where one
    # applies, exact or partial; random elsewhere)
    image_init: str = "random"
    # with image_init closed_form: hold the images the solver's own check pinned down exactly (a partial
    # separation's found images) at their values, so the optimization learns only the rest and the masks
    hold_certain: bool = False
    # with hold_certain: every this many iterations (0: never), the images the closed form can tell exactly
    # from the optimization's (``Solver.snap``: dark_background's nearest image with a background) join the
    # held ones, so each stage learns fewer (docs/results/deployed.md: the MLP's B = 64 SGD round)
    snap_every: int = 0
    # hold the dummies in the images' span, the row space of the first Linear's gradient (engine/span.py:
    # a first Linear on the flattened image and a one-step gradient or an SGD update; ignored elsewhere)
    image_span: bool = False
    tv_weight: float | None = None  # None: 1e-5 for MLP and ViT, 1e-2 for LeNet and ResNet
    lr: float = 0.1
    signed_gradients: bool = True
    boxed: bool = True
    lambda_mask: float = 1e-4
    mask_init: str = "bernoulli"
    max_iterations: int = 20_000
    patience: int = 4_000  # stop after this many iterations without improvement
    schedule: str = "plateau"  # the learning rate's: plateau (the paper's) or multistep (job_adam.SCHEDULES)
    plateau_patience: int = 800
    plateau_factor: float = 0.1  # the schedule's factor (plateau: on a plateau; multistep: at each step)
    restarts: int = 1  # independent starts per victim, optimized together; the lowest loss is kept
    optimizer: str = "adam"  # a name in OPTIMIZERS; lr is its step size (L-BFGS: 1 is the usual one)
    loss_threshold: float = 1e-5
    # The batch order of an update's local round: known (in-order batches, one set of N dummies) or
    # unknown (one copy of the N dummies per epoch, tied by the lambda_order prior; needs per-step labels).
    replay_order: str = "known"
    lambda_order: float | None = None  # None: 1e-2 for unknown-order jobs (objectives.order_term); 0 otherwise
    replay: bool = True  # update captures: replay the client's local steps; False: Δ/(lr·K) as one gradient (baseline)
    # Adam update captures: the replay's ε (not the client's) starts at replay_eps_start and falls
    # geometrically to replay_eps_end over the first replay_eps_anneal of max_iterations, then stays
    # there. Adam's first step is ≈ lr·sign(g), flat in g (and in the masks' scale) at the client's
    # ε = 1e-8: a larger ε gives the dummies and masks a gradient. replay_eps_start None: the client's ε
    # throughout; replay_eps_end None: the client's ε at the end (the client's exact round).
    replay_eps_start: float | None = 1e-3
    replay_eps_end: float | None = 1e-5
    replay_eps_anneal: float = 1.0
    # A closed-form attack (attacker.closed_form.solvers.SOLVERS): solved in one shot, no optimization;
    # "" for the optimization attacks. Set by make_attack from the solver's name, never by a user.
    solver: str = ""

    def __post_init__(self) -> None:
        if self.masks not in MASK_MODES:
            raise AttackConfigError(f"attack {self.name}: masks must be one of {tuple(MASK_MODES)}, got {self.masks!r}")
        if self.distance not in DISTANCES:
            raise AttackConfigError(
                f"attack {self.name}: distance must be one of {tuple(DISTANCES)}, got {self.distance!r}"
            )
        if self.replay_order not in REPLAY_ORDERS:
            raise AttackConfigError(
                f"attack {self.name}: replay_order must be one of {REPLAY_ORDERS}, got {self.replay_order!r}"
            )
        if self.optimizer not in ATTACK_OPTIMIZERS:  # the table itself: an entry added there is accepted
            raise AttackConfigError(
                f"attack {self.name}: optimizer must be one of {tuple(ATTACK_OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.schedule not in SCHEDULES:
            raise AttackConfigError(
                f"attack {self.name}: schedule must be one of {tuple(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.image_init not in IMAGE_INITS:
            raise AttackConfigError(
                f"attack {self.name}: image_init must be one of {IMAGE_INITS}, got {self.image_init!r}"
            )
        if self.hold_certain and self.image_init != "closed_form":
            raise AttackConfigError(
                f"attack {self.name}: hold_certain holds a closed form's images and needs image_init: closed_form"
            )
        if self.snap_every and not self.hold_certain:
            raise AttackConfigError(f"attack {self.name}: snap_every adds to the held images and needs hold_certain")
        if self.mask_init not in MASK_INITS:
            raise AttackConfigError(
                f"attack {self.name}: mask_init must be one of {MASK_INITS}, got {self.mask_init!r}"
            )
        for key, allowed in _NUMBERS.items():
            value = getattr(self, key)
            problem = allowed.problem(value)
            if problem:
                # YAML 1.1 reads 1e-4 (no dot) as a string
                hint = " (YAML reads 1e-4 as text: write 1.0e-4)" if isinstance(value, str) else ""
                raise AttackConfigError(f"attack {self.name}: {key} must be {problem}, got {value!r}{hint}")
        anneal = self.replay_eps_anneal
        if anneal not in _FRACTION:
            raise AttackConfigError(
                f"attack {self.name}: replay_eps_anneal is a fraction of max_iterations and must be "
                f"{_FRACTION.describe()} (a schedule no longer than the budget), got {anneal!r}"
            )

    def tv_for(self, model_name: str) -> float:
        return term_weight(self, "tv_weight", model_name)

    @property
    def receives_oracle(self) -> bool:
        """The threat model in one place: only a mask mode that replays true masks (WIIG) may see
        the client's ground truth; IG and DIA see only what the server saw."""
        return MASK_MODES[self.masks].uses_oracle

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, AttackConfig] = {
    "ig_eval": AttackConfig("ig_eval", masks="off", lambda_mask=0.0),
    "ig_train": AttackConfig("ig_train", masks="random", lambda_mask=0.0),
    "wiig": AttackConfig("wiig", masks="oracle", lambda_mask=0.0),
    "dia": AttackConfig("dia", masks="learn"),
    "april": AttackConfig("april", masks="off", distance="euclidean", lambda_pos=1e-4, lambda_mask=0.0),
    "dia_april": AttackConfig("dia_april", masks="learn", distance="euclidean", lambda_pos=1e-4),
    # FedAvg updates: DIA on Δ/(lr·K) taken as one gradient, the cheap baseline next to the replay
    "dia_onestep": AttackConfig("dia_onestep", masks="learn", replay=False),
    # DIA started from a closed form's answer, exact or partial (a batch's separation put in the labels'
    # order): where the closed form leaves images unresolved, the optimization goes on from there
    "dia_cf": AttackConfig("dia_cf", masks="learn", image_init="closed_form"),
    # DIA in the images' span started from a closed form's partial answer, holding the images the closed form's
    # own per-image check pinned down: it learns only the rest and the masks (docs/results/deployed.md: the
    # MLP's B = 32 SGD round, dark_background's 14 of 32 held, 32 of 32 recognisable); every 50 iterations the
    # images the closed form can tell exactly from its dummies join the held ones (snap_every; at cap 1,000 on
    # the MLP's B = 64 SGD round 52 of 64, against 47 every 250, 38 every 500 and 51 every 25)
    "dia_hold": AttackConfig(
        "dia_hold", masks="learn", image_init="closed_form", hold_certain=True, image_span=True, snap_every=50
    ),
    # DIA with the dummies held in the images' span read off the first Linear's gradient (B x B unknowns
    # per batch instead of B x pixels): batches of 16-64 and SGD rounds of an MLP
    "dia_span": AttackConfig("dia_span", masks="learn", image_span=True),
    # DIA from four independent starts, the lowest loss kept: an Adam client's FedAvg round has bad basins
    # a start can fall into, which its loss shows without the oracle (docs/results/fedavg.md: MLP K = 4,
    # 0.651 from one start, 0.844 from four, WIIG 0.851); four times DIA's cost
    "dia_multistart": AttackConfig("dia_multistart", masks="learn", restarts=4),
}
ALIASES = {"ig": "ig_eval", "dia-april": "dia_april", "ig-eval": "ig_eval", "ig-train": "ig_train"}


# The closed-form attacks, each by its solver's name, and all of them (those that apply) by this one.
CLOSED_FORMS: dict[str, AttackConfig] = {
    name: AttackConfig(name, masks="off", lambda_mask=0.0, solver=name) for name in SOLVERS
}
CLOSED_FORM_GROUP = "closed_form"


def attack_names(names: list[str]) -> list[str]:
    """The attacks a list of names asks for: aliases resolved, ``closed_form`` expanded to every
    solver, each once in the order given."""
    out: list[str] = []
    for name in names:
        key = ALIASES.get(name, name)
        out += list(CLOSED_FORMS) if key == CLOSED_FORM_GROUP else [key]
    return list(dict.fromkeys(out))


def make_attack(name: str, **overrides: Any) -> AttackConfig:
    """A preset or a closed-form attack by name, with overrides checked against the known keys (a
    closed form has no optimization settings: they are accepted for every attack and unused there)."""
    key = ALIASES.get(name, name)
    if key not in PRESETS and key not in CLOSED_FORMS:
        raise AttackConfigError(
            f"unknown attack {name!r}; choose from {sorted(PRESETS)}, the closed forms {sorted(CLOSED_FORMS)} "
            f"or {CLOSED_FORM_GROUP!r} (every closed form that applies)"
        )
    known = {f.name for f in fields(AttackConfig)} - {"name", "masks", "solver"}
    unknown = set(overrides) - known
    if unknown:
        raise AttackConfigError(f"unknown attack setting(s) {sorted(unknown)}; allowed: {sorted(known)}")
    if key in CLOSED_FORMS:
        return CLOSED_FORMS[key]
    return replace(PRESETS[key], **overrides)
