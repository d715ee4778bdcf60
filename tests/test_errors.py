"""Every bad-input error of the project leaves `rlk` with exit code 2, whichever package raised it."""

import pytest

from rl_engine import errors
from rl_engine.artifacts.ids import BadId, check_id
from rl_engine.envs import SettingError
from rl_engine.runtime.plan import PlanError, cell_plan
from rl_engine.runtime.routing import RouteUnavailable


@pytest.mark.parametrize("exc", [
    PlanError("unknown cell"), BadId("run id '..'"), SettingError("RLK_X='two'"),
    RouteUnavailable("strict training route of module ffn cannot run"),
    errors.BadInput("bad"), FileNotFoundError("missing"),
])
def test_bad_input_exits_2(exc):
    assert errors.exit_code_for(exc) == errors.BAD_INPUT == 2


@pytest.mark.parametrize("exc, code", [
    (errors.ParityFailure("bits differ"), 1), (errors.InfrastructureError("worker died"), 3),
    (RuntimeError("anything else"), 3),
])
def test_other_errors_keep_their_codes(exc, code):
    assert errors.exit_code_for(exc) == code


def test_raised_errors_keep_the_base_their_callers_catch():
    """Callers catch these as ValueError or RuntimeError; being BadInput too must not change that."""
    with pytest.raises(ValueError):
        check_id("..")
    with pytest.raises(ValueError):
        cell_plan("no-such-cell")
    assert issubclass(RouteUnavailable, RuntimeError)
