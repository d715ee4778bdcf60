import pytest

from rl_engine.artifacts import ids
from rl_engine.evidence import layout as run_dir
from rl_engine.errors import BadInput
from rl_engine.step.config import StepConfig

_RUNBOOK = ("TP_SIZE", "CP_SIZE", "ACTOR_GPUS", "ROLLOUT_GPUS", "ROLLOUT_GPUS_PER_ENGINE",
            "ROLLOUT_BATCH_SIZE", "N_SAMPLES_PER_PROMPT", "MAX_RESPONSE_LEN", "GLOBAL_BATCH_SIZE",
            "MAX_TOKENS_PER_GPU")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _RUNBOOK:
        monkeypatch.delenv(name, raising=False)


def test_default_workload_is_the_runbooks():
    c = StepConfig.resolve()
    assert (c.tp, c.cp, c.dp, c.engines, c.rollout_gpus_per_engine) == (2, 2, 1, 2, 2)
    assert (c.rollout_batch_size, c.n_samples_per_prompt, c.max_response_len) == (1, 2, 128)
    assert c.numel_per_step == 256


def test_runbook_variables_override_the_preset_and_flags_override_them(monkeypatch):
    monkeypatch.setenv("TP_SIZE", "1")
    monkeypatch.setenv("ACTOR_GPUS", "4")
    monkeypatch.setenv("ROLLOUT_GPUS_PER_ENGINE", "1")
    c = StepConfig.resolve("ci", cp=2)
    assert (c.tp, c.cp, c.dp, c.engines) == (1, 2, 2, 2)


def test_a_trainer_tp_other_than_the_engines_tp_is_refused_naming_why():
    with pytest.raises(BadInput, match="TP_SIZE=1 differs from ROLLOUT_GPUS_PER_ENGINE=2: the trainer "
                                       "and the rollout engines compute the same bits only at the "
                                       "same TP size"):
        StepConfig.resolve("ci", tp=1, actor_gpus=1)


def test_engine_ids_default_to_builtin_and_unknown_ones_are_refused(monkeypatch):
    c = StepConfig.resolve("ci")
    assert (c.trainer, c.rollout_engine) == ("builtin", "builtin")
    assert c.as_dict()["trainer"] == "builtin"
    with pytest.raises(BadInput, match="--rollout-engine 'sglang': use one of builtin"):
        StepConfig.resolve("ci", rollout_engine="sglang")


@pytest.mark.parametrize("env, message", [
    ({"ACTOR_GPUS": "3"}, "ACTOR_GPUS=3 is not a multiple of TP_SIZE x CP_SIZE"),
    ({"ROLLOUT_GPUS": "3"}, "ROLLOUT_GPUS=3 is not a multiple of ROLLOUT_GPUS_PER_ENGINE"),
    ({"GLOBAL_BATCH_SIZE": "5"}, "GLOBAL_BATCH_SIZE=5 differs"),
    ({"MAX_RESPONSE_LEN": "0"}, "MAX_RESPONSE_LEN=0 must be at least 1"),
])
def test_layouts_that_cannot_be_honoured_are_refused(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(BadInput, match=message):
        StepConfig.resolve()


def test_a_non_integer_setting_names_the_variable(monkeypatch):
    from rl_engine.envs import SettingError

    monkeypatch.setenv("TP_SIZE", "two")
    with pytest.raises(SettingError, match="TP_SIZE='two' is not an integer"):
        StepConfig.resolve()


@pytest.mark.parametrize("bad", ["a/b", "..", "x..y", "", "run id", "../etc"])
def test_run_ids_that_could_escape_are_refused(bad):
    with pytest.raises(ids.BadId):
        ids.check_id(bad)


def test_attempt_ids_sort_by_time():
    from datetime import datetime, timezone

    a = ids.new_attempt_id(datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc))
    b = ids.new_attempt_id(datetime(2026, 1, 2, 3, 4, 6, tzinfo=timezone.utc))
    assert a.startswith("20260102T030405Z-") and len(a.split("-")[1]) == 6 and a < b
    # Within one second the microseconds order them, whatever the random digit.
    c = ids.new_attempt_id(datetime(2026, 1, 2, 3, 4, 5, 999, tzinfo=timezone.utc))
    d = ids.new_attempt_id(datetime(2026, 1, 2, 3, 4, 5, 1000, tzinfo=timezone.utc))
    late = ids.new_attempt_id(datetime(2026, 1, 2, 3, 4, 5, 999_999, tzinfo=timezone.utc))
    assert a < c < d < late < b


def test_a_run_directory_is_never_reused(tmp_path):
    run = run_dir.create(tmp_path / "r1")
    (run.root / "run.log").write_text("x")
    with pytest.raises(BadInput, match="already holds a run"):
        run_dir.create(tmp_path / "r1")


def test_placement_sets_the_gpus_a_layout_takes():
    shared = StepConfig.resolve("default")
    assert shared.colocate and (shared.gpus, shared.rollout_first_gpu) == (4, 0)
    separate = StepConfig.resolve("default", colocate=False)
    assert (separate.gpus, separate.rollout_first_gpu) == (8, 4)
    assert separate.as_dict()["colocate"] is False and separate.as_dict()["gpus"] == 8
