"""labkit.peers finds a built llama-server in the cache, or says why not and how to build it;
nothing here builds anything (that is ``make peers``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from labkit.peers import BUILD_COMMAND, LlamaServer, PeerMissing, llama_server, peers_dir


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    return tmp_path


def test_an_empty_cache_has_no_peer_and_names_the_command_that_builds_it(cache: Path) -> None:
    found = llama_server()
    assert isinstance(found, PeerMissing)
    assert "llama-server is not built" in found.reason and BUILD_COMMAND in found.reason
    assert peers_dir() == cache / "peers" / "llama.cpp"


def test_a_built_binary_without_its_gguf_is_not_a_peer(cache: Path) -> None:
    binary = peers_dir() / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    found = llama_server()
    assert isinstance(found, PeerMissing) and "GGUF" in found.reason


def test_a_built_peer_is_found_with_its_start_command(cache: Path) -> None:
    root = peers_dir()
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text("#!/bin/sh\n")
    (root / "bin" / "llama-server").chmod(0o755)
    (root / "smollm2-f32.gguf").write_bytes(b"GGUF")
    found = llama_server()
    assert found == LlamaServer(root / "bin" / "llama-server", root / "smollm2-f32.gguf")
    command = found.command(8123, parallel=4, threads=2)
    assert command[:3] == [str(found.binary), "-m", str(found.gguf)]
    assert " ".join(command[3:]) == "-np 4 -cb -c 8192 -t 2 --port 8123 --host 127.0.0.1"
