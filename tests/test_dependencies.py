"""What labkit imports is declared, what is declared is used or says why, and the lock agrees.

Why: h11, anyio, starlette, pydantic and jinja2 were imported but not declared (installed only
because something else pulled them in), accelerate was declared with no word on why, uvicorn was
unpinned although labkit subclasses its private H11Protocol, and nothing pinned the versions the
lab was measured with. pyproject.toml states ranges; requirements.lock (``make lock``) pins one
version of everything ``make`` installs; environment.yml lists the same packages for conda.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.util
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from labkit.service import uvicorn_internals

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LAB_MODULES = ("labkit/lab/", "labkit/experiments/", "labkit/plots.py", "labkit/rerun.py")  # need the lab extra
# Declared in the core without being imported: each for a reason that a test below keeps true.
INDIRECT = {
    "gguf": "transformers reads SmolLM2's GGUF weights with it",
    "accelerate": "transformers refuses to load a GGUF file without it",
}


def requirements(*groups: str) -> dict[str, Requirement]:
    """The requirements of ``core`` and the named extras, by canonical name (an extra's line wins)."""
    lines = list(PROJECT["dependencies"]) if "core" in groups else []
    for group in groups:
        lines += PROJECT["optional-dependencies"].get(group, [])
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def imports(path: Path) -> set[str]:
    """Top-level names of third-party modules ``path`` imports, except inside ``try`` blocks that
    catch ImportError (optional: the code goes on without them)."""
    tree = ast.parse(path.read_text())
    optional = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.Try) and any(_catches_import_error(h) for h in block.handlers)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "labkit"}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def distributions(module: str) -> set[str]:
    return {canonicalize_name(d) for d in _installed().get(module, [])}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return dict(metadata.packages_distributions())  # reads every installed distribution: once


def undeclared(files: list[Path], declared: set[str]) -> list[str]:
    """``module (file)`` for each import whose distribution ``declared`` lacks."""
    problems = []
    for path in files:
        for module in sorted(imports(path)):
            if not distributions(module) & declared:
                problems.append(
                    f"{module} ({path.name}; from {sorted(distributions(module)) or 'no installed distribution'})"
                )
    return problems


def labkit_files() -> tuple[list[Path], list[Path]]:
    """labkit's modules: those the core installation must run, and those that need the lab extra."""
    every = sorted((ROOT / "labkit").rglob("*.py"))
    lab = [p for p in every if str(p.relative_to(ROOT)).startswith(LAB_MODULES)]
    return [p for p in every if p not in lab], lab


def test_every_package_labkit_imports_is_declared() -> None:
    core, lab = labkit_files()
    assert undeclared(core, set(requirements("core"))) == []
    assert undeclared(lab, set(requirements("core", "lab"))) == []


def test_an_undeclared_import_is_found_and_an_optional_one_is_not(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import h11\nimport json\ntry:\n    import psutil\nexcept ImportError:\n    psutil = None\n")
    assert imports(module) == {"h11"}
    assert undeclared([module], {"fastapi", "uvicorn"}) == ["h11 (m.py; from ['h11'])"]
    assert undeclared([module], {"h11"}) == []


def test_every_core_dependency_is_imported_or_says_why() -> None:
    core, lab = labkit_files()
    imported = set().union(*(distributions(m) for path in core + lab for m in imports(path)))
    assert set(requirements("core")) - imported - {"torch"} <= set(INDIRECT) and "torch" in imported
    text = (ROOT / "pyproject.toml").read_text()
    for name in INDIRECT:  # the reason is written beside the requirement
        assert re.search(rf'"{name}[^"]*",\s*# not imported: ', text), name


def test_transformers_still_needs_accelerate_and_gguf_to_read_a_gguf_file() -> None:
    """If transformers stops requiring them, drop them from pyproject.toml."""
    source = Path(importlib.util.find_spec("transformers.modeling_utils").origin).read_text()
    assert "accelerate is required when loading a GGUF file" in source
    gguf_reader = Path(importlib.util.find_spec("transformers.modeling_gguf_pytorch_utils").origin).read_text()
    assert "from gguf import" in gguf_reader or "import gguf" in gguf_reader


# -- the lock ------------------------------------------------------------------------------------
def locked() -> dict[str, str]:
    """requirements.lock's pins, by canonical name."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.lock").read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pins}


def lock_disagreements(pins: dict[str, str]) -> list[str]:
    """What the lock fails to pin, or pins outside pyproject.toml's range; [] when they agree."""
    problems = []
    for name, requirement in requirements("core", "lab", "dev").items():
        if name not in pins:
            problems.append(f"not in requirements.lock: {requirement}")
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            problems.append(f"requirements.lock pins {name}=={pins[name]}, outside pyproject.toml's {requirement}")
    return problems


def test_the_lock_pins_every_declared_package_within_its_range() -> None:
    assert lock_disagreements(locked()) == []


def test_a_lock_out_of_range_or_missing_a_package_is_reported() -> None:
    pins = locked()
    pins["uvicorn"] = "0.60.0"
    del pins["h11"]
    assert lock_disagreements(pins) == [
        "requirements.lock pins uvicorn==0.60.0, outside pyproject.toml's uvicorn<0.55,>=0.54",
        "not in requirements.lock: h11<0.17,>=0.16",
    ]


def test_the_lock_installs_anywhere() -> None:
    """No index, find-links or local path of this machine, and torch without a local label (+cpu):
    the same line then installs the CPU wheel here and PyPI's elsewhere."""
    text = (ROOT / "requirements.lock").read_text()
    assert not re.search(r"^\s*-", text, re.M) and "file://" not in text and "/opt/" not in text
    assert locked()["torch"] == "2.13.0"


def test_the_installed_core_packages_are_the_locked_ones() -> None:
    """The environment these tests run in is the one the lock describes (after `make`)."""
    pins = locked()
    stale = {}
    for name in requirements("core", "lab"):
        installed = metadata.version(name).split("+")[0]
        if installed != pins[name]:
            stale[name] = (installed, pins[name])
    assert stale == {}, f"installed vs locked (run make to reinstall): {stale}"


# -- uvicorn's internals -------------------------------------------------------------------------
def missing_state() -> list[str]:
    """Every internal used, checked on real instances: a protocol, a request cycle, a server."""
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
    from uvicorn.server import ServerState

    async def app(scope: Any, receive: Any, send: Any) -> None:  # never called
        raise AssertionError

    config = uvicorn.Config(app, loop="asyncio", http=H11Protocol)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = H11Protocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        cycle = RequestResponseCycle(
            scope={"type": "http"},  # type: ignore[typeddict-item]
            conn=h11.Connection(h11.SERVER),
            transport=None,  # type: ignore[arg-type]
            flow=None,  # type: ignore[arg-type]
            logger=None,  # type: ignore[arg-type]
            access_logger=None,  # type: ignore[arg-type]
            access_log=False,
            default_headers=[],
            message_event=asyncio.Event(),
            on_response=lambda: None,
        )
        server = uvicorn.Server(config)
    finally:
        loop.close()
    missing = uvicorn_internals.missing_methods()
    missing += [f"H11Protocol().{n}" for n in uvicorn_internals.PROTOCOL_STATE if not hasattr(protocol, n)]
    missing += [f"RequestResponseCycle().{n}" for n in uvicorn_internals.CYCLE_STATE if not hasattr(cycle, n)]
    missing += [f"Server().{n}" for n in uvicorn_internals.SERVER_USES if not hasattr(server, n)]
    return missing


def test_uvicorn_is_a_tested_version_with_every_internal_labkit_uses() -> None:
    assert uvicorn_internals.is_tested_version(), (
        f"uvicorn {metadata.version('uvicorn')} is not the tested {uvicorn_internals.PIN}: check "
        "service/connections.py and server.py against it, run the service tests, then move the pin"
    )
    assert missing_state() == []
    pinned = requirements("core")["uvicorn"]
    assert f"uvicorn{pinned.specifier}" == "uvicorn<0.55,>=0.54" and uvicorn_internals.PIN == "uvicorn>=0.54,<0.55"


def test_a_missing_uvicorn_internal_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    monkeypatch.delattr(H11Protocol, "_unset_keepalive_if_required")
    with pytest.raises(
        uvicorn_internals.UnsupportedUvicorn,
        match=r"H11Protocol\._unset_keepalive_if_required.*pip install 'uvicorn>=0.54,<0.55'",
    ):
        uvicorn_internals.check()
