import pytest

from rl_engine.cli import main
from rl_engine.runtime.plan import ALL_CELLS, Plan, PlanError, cell_plan, normalize_cell


def test_every_cell_maps_to_a_plan_and_back():
    for cell in ALL_CELLS:
        assert cell_plan(cell).cell == cell
    assert cell_plan("ffn-PR") == Plan(ffn="P/R")
    assert Plan(ffn="P/R").impl("ffn", "training") == "P"
    assert Plan(ffn="P/R").impl("ffn", "rollout") == "R"


def test_module_case_names_map_to_cell_ids():
    assert normalize_cell("attention:P/R") == "attention-PR"
    assert normalize_cell("logp:P/P") == "logp-PP"
    assert normalize_cell("ffn:R/R") == "control"
    with pytest.raises(PlanError, match="unknown cell"):
        normalize_cell("attention:X/R")


@pytest.mark.parametrize("case", ["X/R", "R", "r/r", "R/R/R", ""])
def test_bad_case_is_refused_with_the_allowed_values(case):
    with pytest.raises(PlanError, match="P/P, P/R, R/P, R/R"):
        Plan(attention=case)


def test_unknown_case_in_the_environment_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("RL_KERNEL_LOGP_CASE", "X/R")
    assert main(["preflight"]) == 2
    assert "RL_KERNEL_LOGP_CASE='X/R'" in capsys.readouterr().err


def test_plan_from_env_defaults_to_the_control(monkeypatch):
    for name in ("ATTENTION", "FFN", "LOGP"):
        monkeypatch.delenv(f"RL_KERNEL_{name}_CASE", raising=False)
    monkeypatch.setenv("RL_KERNEL_FFN_CASE", "R/P")
    assert Plan.from_env() == Plan(ffn="R/P")
