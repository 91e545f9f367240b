"""One ServiceConfig: each layer's dataclass nested as that layer defines it, flat names routed to
their layer, and ``labkit serve``'s flags made from the fields (nothing copied between layers)."""
from __future__ import annotations

import argparse
import ast
from dataclasses import fields
from pathlib import Path

import pytest

from labkit.engine.config import EngineConfig
from labkit.hub import HubConfig
from labkit.server import add_serve_arguments, config_from_args
from labkit.service.config import HttpConfig, ServiceConfig, layer_of, leaves

REPO = Path(__file__).resolve().parents[1]


def test_the_config_nests_one_dataclass_per_layer() -> None:
    config = ServiceConfig()
    assert isinstance(config.engine, EngineConfig) and isinstance(config.hub, HubConfig)
    assert isinstance(config.http, HttpConfig)


def test_flat_names_are_routed_to_their_layer() -> None:
    config = ServiceConfig.of(max_batch=4, policy="drop", sndbuf=65536, pad_bytes=128)
    assert config.engine.max_batch == 4 and config.hub.policy == "drop"
    assert config.http.sndbuf == 65536 and config.pad_bytes == 128
    assert config.engine == EngineConfig(max_batch=4, max_waiting=ServiceConfig().engine.max_waiting)
    assert config.replace(max_batch=8).engine.max_batch == 8 and config.engine.max_batch == 4
    assert config.flat()["policy"] == "drop" and set(config.flat()) == {f.name for _, _, f in leaves()}
    assert [layer_of(n) for n in ("max_batch", "policy", "host", "drain_grace")] == ["engine", "hub", "http", None]


def test_an_unknown_name_is_refused_with_a_suggestion() -> None:
    with pytest.raises(TypeError, match="no setting 'max_bach'; did you mean max_batch"):
        ServiceConfig.of(max_bach=4)


def test_a_bad_value_names_its_layer_and_field() -> None:
    with pytest.raises(ValueError, match="EngineConfig.max_batch"):
        ServiceConfig.of(max_batch=0)
    with pytest.raises(ValueError, match="HttpConfig.send_timeout"):
        ServiceConfig.of(send_timeout=0)
    with pytest.raises(ValueError, match="HttpConfig.allowed_hosts"):
        ServiceConfig.of(allowed_hosts=("LOCALHOST",))


def test_every_leaf_is_one_flag_with_its_layers_default() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    by_dest = {action.dest: action for action in parser._actions}
    defaults = ServiceConfig().flat()
    for _, _, f in leaves():
        assert by_dest[f.name].default == defaults[f.name], f.name
    args = parser.parse_args(["--allowed-hosts", "api.test,LOCALHOST", "--lab-routes", "--send-timeout", "2.5",
                              "--idle-wait", "0.1", "--dtype", "bfloat16"])
    config = config_from_args(args)
    assert config.http.allowed_hosts == ("api.test", "localhost") and config.http.lab_routes is True
    assert config.http.send_timeout == 2.5 and config.hub.idle_wait == 0.1 and config.engine.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])


def test_the_service_package_never_imports_the_launcher() -> None:
    for path in (REPO / "labkit" / "service").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert "labkit.server" not in imported, path.name


def test_each_layer_holds_its_own_fields_only() -> None:
    """No field name of a layer is repeated on ServiceConfig itself (one home per default)."""
    own = {f.name for f in fields(ServiceConfig)}
    for kind in (EngineConfig, HubConfig, HttpConfig):
        assert not own & {f.name for f in fields(kind)}, kind.__name__
