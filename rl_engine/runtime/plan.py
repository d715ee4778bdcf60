"""The operator plan: for each routed module, which implementation each side runs.

A case is written `T/R`: the training side's letter, then the rollout side's; `P` is the production
implementation, `R` rl_engine's deterministic one. Cells of the matrix name one plan each.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rl_engine import envs
from rl_engine.errors import BadInput

MODULES: tuple[str, ...] = ("attention", "ffn", "logp")
CASES: tuple[str, ...] = ("P/P", "P/R", "R/P", "R/R")
SIDES: tuple[str, ...] = ("training", "rollout")
MODES: tuple[str, ...] = ("strict", "audit")
ISOLATION_CELLS: tuple[str, ...] = tuple(
    f"{m}-{c.replace('/', '')}" for m in MODULES for c in ("P/R", "R/P", "P/P"))
ALL_CELLS: tuple[str, ...] = ("control", *ISOLATION_CELLS, "baseline")

Side = Literal["training", "rollout"]


class PlanError(BadInput, ValueError):
    """A case, cell or mode that is not one of the allowed values (exit code 2)."""


def check_case(module: str, case: str) -> str:
    if case not in CASES:
        raise PlanError(f"{module} case {case!r} is not allowed; use one of {', '.join(CASES)}")
    return case


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    attention: str = "R/R"
    ffn: str = "R/R"
    logp: str = "R/R"
    mode: str = "strict"

    def __post_init__(self) -> None:
        for module in MODULES:
            check_case(module, getattr(self, module))
        if self.mode not in MODES:
            raise PlanError(f"mode {self.mode!r} is not allowed; use strict or audit")

    def case(self, module: str) -> str:
        if module not in MODULES:
            raise PlanError(f"unknown module {module!r}; modules are {', '.join(MODULES)}")
        return getattr(self, module)

    def impl(self, module: str, side: Side) -> str:
        """'R' or 'P' for this module on this side."""
        if side not in SIDES:
            raise PlanError(f"unknown side {side!r}; sides are training and rollout")
        return self.case(module)[0 if side == "training" else 2]

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @property
    def cell(self) -> str | None:
        """The matrix cell this plan is, or None for a plan no cell names."""
        for cell in ALL_CELLS:
            if cell_plan(cell, mode=self.mode) == self:
                return cell
        return None

    @classmethod
    def from_env(cls) -> Plan:
        """The plan of RL_KERNEL_{ATTENTION,FFN,LOGP}_CASE (R/R where unset) and RLK_MODE."""
        cases = {}
        for module in MODULES:
            value = getattr(envs, f"RL_KERNEL_{module.upper()}_CASE")
            if value is not None:
                if value not in CASES:
                    raise PlanError(f"RL_KERNEL_{module.upper()}_CASE={value!r} is not allowed; "
                                    f"use one of {', '.join(CASES)}")
                cases[module] = value
        return cls(**cases, mode=envs.RLK_MODE)


def cell_plan(cell: str, *, mode: str = "strict") -> Plan:
    cell = normalize_cell(cell)
    if cell == "control":
        return Plan(mode=mode)
    if cell == "baseline":
        return Plan(attention="P/P", ffn="P/P", logp="P/P", mode=mode)
    module, short = cell.split("-")
    return Plan(**{module: f"{short[0]}/{short[1]}"}, mode=mode)


def normalize_cell(name: str) -> str:
    """A cell id, or `module:case` (attention:P/R) mapped to its cell id."""
    if name in ALL_CELLS:
        return name
    if ":" in name:
        module, case = name.split(":", 1)
        if module in MODULES and case in CASES:
            if case == "R/R":
                return "control"
            return f"{module}-{case.replace('/', '')}"
    raise PlanError(f"unknown cell {name!r}; use one of {', '.join(ALL_CELLS)} or module:case "
                    "such as attention:P/R")
