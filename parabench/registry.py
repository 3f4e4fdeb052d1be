"""Every strategy by name: the rows of ``parabench.families`` (``parabench.strategies.StrategySpec``).

Reading the registry imports no torch; a row's builder is imported only when a trainer is built.
"""

from __future__ import annotations

from parabench.families import ROWS
from parabench.names import unknown_name
from parabench.recipes import recipe_name
from parabench.strategies import StrategySpec
from parabench.theory import Expectation


def _by_name(rows) -> dict[str, StrategySpec]:
    table: dict[str, StrategySpec] = {}
    for row in rows:
        if row.name in table:
            raise ValueError(f"strategy {row.name!r} registered twice")
        table[row.name] = row
    return table


# Each family module (parabench/families/) lists its strategies' rows; adding a strategy is a row there.
STRATEGIES: dict[str, StrategySpec] = _by_name(ROWS)


def get_strategy(name: str) -> StrategySpec:
    if name not in STRATEGIES:
        raise unknown_name("strategy", name, sorted(STRATEGIES))
    return STRATEGIES[name]


def expected(case, cfg, dp: int) -> Expectation | None:
    """The analytic expectation of a case (``parabench.theory``), from its strategy's
    row (None where there is none)."""
    spec = get_strategy(case.strategy)
    return spec.expect(cfg, case, spec.options.read(case.options), dp) if spec.expect else None


def routed_comm_per_rank(case, cfg, per_rank: list[dict]) -> list[dict] | None:
    """Per-rank traffic made exact from a data-dependent decision the ranks recorded (expert
    routing); None for strategies without one."""
    spec = get_strategy(case.strategy)
    return spec.routed_comm(case, cfg, per_rank) if spec.routed_comm else None


def register(row: StrategySpec) -> StrategySpec:
    """Add a strategy defined outside ``parabench.families`` (a project's own module, imported before
    its cases run); a name already taken is a ValueError."""
    if row.name in STRATEGIES:
        raise ValueError(f"strategy {row.name!r} registered twice")
    STRATEGIES[row.name] = row
    return row


def reporting(section: str) -> tuple[str, ...]:
    """The strategies whose rows name the report's ``section`` (``StrategySpec.report_sections``)."""
    return tuple(name for name, row in STRATEGIES.items() if section in row.report_sections)


def recipe_of(case: dict) -> str | None:
    """A stored case's recipe ("master" | "amp" | "fp8"; None in fp32); for a record made before cases
    named one, what its strategy's row says bf16/fp16 meant then (``StrategySpec.legacy_recipe``)."""
    if case.get("precision", "fp32") == "fp32":
        return None
    if case.get("recipe"):
        return case["recipe"]
    row = STRATEGIES.get(case.get("strategy") or "")
    return row.legacy_recipe if row is not None else "master"


def grad_reduce_dtype(case: dict) -> str | None:
    """The dtype a stored case's gradients were reduced in ("fp32" | "bf16" | "fp16"), from its
    strategy's row (``StrategySpec.grad_reduce_dtype``); None for a strategy the registry does not have."""
    row = STRATEGIES.get(case.get("strategy") or "")
    if row is None:
        return None
    return row.grad_reduce_dtype(case.get("precision", "fp32"), recipe_of(case), case.get("options") or {})


# The report sets a reference's speed beside a peer's (a ratio) only where both ran the same model
# on the same devices in the same precision recipe (``recipe_name``), model layout and micro-batch:
# pairs that differ there are never made. The dtype the gradients are reduced in is the one axis a
# library may not let a pair share (tuned FSDP2 reduces in fp32, as torchtitan does; the references
# in the compute dtype): such a pair is made, and its ratio carries ``pair_note``.
PAIRED_ON = ("precision", "layout", "micro_batch")


def pair_facts(case: dict) -> dict:
    """What ``PAIRED_ON`` and ``pair_note`` read, of a stored case (report rows carry the same keys)."""
    return {
        "precision": recipe_name(case.get("precision", "fp32"), recipe_of(case)),
        "layout": case.get("layout") or "separate",
        "micro_batch": case.get("micro_batch"),
        "grad_reduce": grad_reduce_dtype(case),
    }


def can_pair(reference: dict, peer: dict) -> bool:
    """Whether the report may set these two (``pair_facts``, or report rows) side by side."""
    return all(reference.get(k) == peer.get(k) for k in PAIRED_ON)


def pair_note(reference: dict, peer: dict) -> str | None:
    """What a pair that ``can_pair`` allows does not share, in words for beside its ratio; None when
    it is like for like. A pair ``can_pair`` refuses is a ValueError."""
    if not can_pair(reference, peer):
        differ = [k for k in PAIRED_ON if reference.get(k) != peer.get(k)]
        raise ValueError(f"not a pair: they differ in {', '.join(differ)}")
    ref, other = reference.get("grad_reduce"), peer.get("grad_reduce")
    if ref and other and ref != other:
        return f"peer reduces gradients in {other}, reference in {ref}"
    return None
