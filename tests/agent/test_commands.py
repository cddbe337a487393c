"""What the device answers the fleet's commands with, shown as an operator configured it."""
from __future__ import annotations

from agent.config import AgentConfig, ApiConfig
from agent.link.commands import Commands, Device, LiveSettings
from agent.wire import CommandRequest, CommandResponse


def get_config(config: AgentConfig) -> dict:
    answer = Commands(Device(config, LiveSettings()))("get_config", CommandRequest())
    assert answer.ok, answer.error
    # as the fleet reads it: through the wire's JSON
    return CommandResponse.model_validate_json(answer.model_dump_json()).result["config"]


def test_get_config_shows_the_socket_mode_as_configured():
    """Found by a new user: get_config showed socket_mode 432 for the "0660" the config file said."""
    assert get_config(AgentConfig())["api"]["socket_mode"] == "0660"
    assert get_config(AgentConfig(api=ApiConfig(socket_mode="0600")))["api"]["socket_mode"] == "0600"
    assert get_config(AgentConfig(api=ApiConfig(socket_mode=0o7)))["api"]["socket_mode"] == "0007"
    # and it reads back as the same mode
    assert ApiConfig(socket_mode=get_config(AgentConfig())["api"]["socket_mode"]).socket_mode == 0o660
