"""benchmarks/llama_cpp_prebuild.py without building llama.cpp: the toolkit root it assembles (the compiler copied,
cuBLAS added, a driver stub with the driver's soname), and tools packed here arriving where llama_cpp_peer.py's `run`
looks for them on the device, in pieces, with the libraries they load on the library path."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import llama_cpp_peer  # noqa: E402
import llama_cpp_prebuild  # noqa: E402


def test_the_toolkit_root_has_the_compiler_cublas_and_a_driver_stub(tmp_path, monkeypatch):
    system = tmp_path / "cuda-13.0"
    for name, text in (("bin/nvcc", "#!/bin/sh\n"), ("include/cuda_runtime.h", ""), ("lib/libcudart.so.13", "")):
        (system / name).parent.mkdir(parents=True, exist_ok=True)
        (system / name).write_text(text)
    cublas = tmp_path / "wheel" / "nvidia" / "cu13"
    for name in ("include/cublas_v2.h", "lib/libcublas.so.13", "lib/libcublasLt.so.13"):
        (cublas / name).parent.mkdir(parents=True, exist_ok=True)
        (cublas / name).write_text(name)
    monkeypatch.setattr(llama_cpp_prebuild, "SYSTEM_CUDA", system)
    root = llama_cpp_prebuild._toolkit(tmp_path / "here", cublas)
    assert (root / "bin" / "nvcc").is_file() and not (root / "bin" / "nvcc").is_symlink()  # (finds its root by path)
    assert (root / "include" / "cuda_runtime.h").exists() and (root / "include" / "cublas_v2.h").exists()
    assert (root / "lib" / "libcublas.so").read_text() == "lib/libcublas.so.13"
    assert (root / "lib64" / "libcublasLt.so").read_text() == "lib/libcublasLt.so.13"
    assert (root / "targets" / "x86_64-linux" / "lib" / "libcudart.so.13").exists()
    stub = (root / "lib" / "stubs" / "libcuda.so").read_bytes()
    assert stub.startswith(b"\x7fELF") and b"libcuda.so.1" in stub  # the soname the tools will ask the device for
    assert llama_cpp_prebuild._toolkit(tmp_path / "here", cublas) == root  # made once


def test_packed_tools_arrive_where_run_looks_and_find_their_libraries(tmp_path, monkeypatch):
    built = tmp_path / "build" / "bin"
    built.mkdir(parents=True)
    tools = {}
    for tool in llama_cpp_peer.TARGETS:
        tools[tool] = np.random.default_rng(len(tool)).bytes(3000)
        (built / tool).write_bytes(tools[tool])
        (built / tool).chmod(0o755)
    libs = tmp_path / "libs"
    libs.mkdir()
    for lib in llama_cpp_prebuild.RUNTIME_LIBS:
        (libs / lib).write_text(lib)
    monkeypatch.setattr(llama_cpp_prebuild, "_system_library", lambda name: libs / name)
    monkeypatch.setattr(llama_cpp_peer, "CHUNK", 2000)  # (random bytes do not compress: several pieces)
    repo = tmp_path / "repo"
    folders = llama_cpp_prebuild.pack(built, repo / ".devwheels")
    assert len(folders) > 1 and [f.name for f in folders] == [f"lcp_bin_{i}" for i in range(1, len(folders) + 1)]
    assert all(len(list(f.iterdir())) == 1 for f in folders)  # one piece a folder: one device call each
    monkeypatch.setattr(llama_cpp_peer, "ROOT", repo)
    monkeypatch.setattr(llama_cpp_peer, "WORK", tmp_path / "work")
    stash = tmp_path / "stash"
    stash.mkdir()
    for folder in folders:
        folder.rename(stash / folder.name)
    for i, folder in enumerate(folders):  # one device call a folder, each with only its own folder carried
        assert not (tmp_path / "work" / "build").exists()  # (not every piece there yet)
        (stash / folder.name).rename(folder)
        llama_cpp_peer.unpack()
        folder.rename(stash / f"carried_{i}")
    bin_dir = tmp_path / "work" / "build" / "bin"
    for tool, data in tools.items():
        assert (bin_dir / tool).read_bytes() == data and (bin_dir / tool).stat().st_mode & stat.S_IXUSR
    for lib in llama_cpp_prebuild.RUNTIME_LIBS:
        assert (bin_dir / lib).read_text() == lib
    monkeypatch.setenv("LD_LIBRARY_PATH", "/elsewhere")
    monkeypatch.setattr(llama_cpp_peer, "_find_cublas", lambda: Path("/site/nvidia/cu13/lib"))
    llama_cpp_peer._library_path(bin_dir)
    assert os.environ["LD_LIBRARY_PATH"] == f"{bin_dir}:/site/nvidia/cu13/lib:/elsewhere"


def test_the_driver_stub_defines_the_driver_functions_a_static_library_calls(tmp_path):
    import subprocess

    (tmp_path / "pool.c").write_text(
        "int cuMemCreate(void); int cudaFree(void); int f(void) { return cuMemCreate() + cudaFree(); }\n"
    )
    subprocess.run(["gcc", "-c", "-o", str(tmp_path / "pool.o"), str(tmp_path / "pool.c")], check=True)
    subprocess.run(["ar", "rcs", str(tmp_path / "libpool.a"), str(tmp_path / "pool.o")], check=True)
    symbols = llama_cpp_prebuild.driver_symbols(tmp_path / "libpool.a")
    assert symbols == ["cuMemCreate"]  # (the runtime's cudaFree is cudart's, not the driver's)
    (tmp_path / "lib").mkdir()
    stub = llama_cpp_prebuild.driver_stub(tmp_path, symbols)
    exported = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True).stdout
    assert " T cuMemCreate" in exported
