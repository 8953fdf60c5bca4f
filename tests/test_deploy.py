"""Deploy files cannot be run here (no Docker engine); they are parsed and checked instead."""

import configparser
import tomllib
from pathlib import Path

import yaml  # installed with hivemind

from dtnode.daemon.settings import NodeSettings

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_example_config_is_valid_settings():
    values = tomllib.loads((DEPLOY / "node.example.toml").read_text())
    settings = NodeSettings(**values)
    assert settings.model == "small" and settings.inner_steps == 500


def test_systemd_unit_runs_join_with_config():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "dtnode.service")
    assert unit["Service"]["ExecStart"].endswith("dtnode join")
    assert "DTNODE_CONFIG=" in unit["Service"]["Environment"]
    assert unit["Service"]["KillSignal"] == "SIGTERM"


def test_dockerfile_and_compose_reference_real_commands():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["dtnode"]' in dockerfile and "/healthz" in dockerfile
    compose = (DEPLOY / "docker-compose.yml").read_text()
    services = yaml.safe_load(compose)["services"]
    assert set(services) == {"node1", "node2", "node3"}
    for service in services.values():
        assert service["command"][0] == "join" and "--run-id" in service["command"]
