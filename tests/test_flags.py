"""One on / off vocabulary for config values, overrides and environment variables."""

import pytest

from tuneforge.flags import env_flag, env_switch, parse_flag


@pytest.mark.parametrize("value", [True, 1, "true", "True", " yes ", "on", "y", "1"])
def test_on(value):
    assert parse_flag(value) is True


@pytest.mark.parametrize("value", [False, 0, "false", "NO", "off", "n", "0"])
def test_off(value):
    assert parse_flag(value) is False


@pytest.mark.parametrize("value", [2, "", "maybe", None, 0.5, [True]])
def test_not_a_flag(value):
    assert parse_flag(value) is None


def test_environment_switches():
    env = {"USE_RAY": "true", "FORCE_TORCHRUN": "0", "HF_HUB_OFFLINE": "on", "ODD": "sure"}
    assert env_flag("USE_RAY", env) and env_flag("HF_HUB_OFFLINE", env)
    assert not env_flag("FORCE_TORCHRUN", env)
    assert not env_flag("ODD", env) and not env_flag("UNSET", env)


def test_a_switch_that_is_on_unless_set_off():
    assert env_switch("UNSET", ValueError, {}) is True
    assert env_switch("X", ValueError, {"X": "off"}) is False and env_switch("X", ValueError, {"X": "yes"}) is True
    with pytest.raises(ValueError, match="X='sure' is not on or off; use 1 or 0"):
        env_switch("X", ValueError, {"X": "sure"})
