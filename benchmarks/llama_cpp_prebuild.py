"""llama.cpp's bench tools built here, on the CPU VM, for the device's GPU: the device then only unpacks and runs them.

    python benchmarks/llama_cpp_prebuild.py build [--arch 90] [-j 2]   # here: an hour or so on 2 cores; resumable
    python benchmarks/llama_cpp_prebuild.py pack                       # here: .devwheels/lcp_bin_1, _2, ...
    device, one call a folder, carry [".devwheels/lcp_bin_K"]:  python benchmarks/llama_cpp_peer.py unpack
    (the last one joins the pieces and puts the tools in WORK/build/bin, where `build` would)
    then `llama_cpp_peer.py write` and `run` as after a build there (llama_cpp_peer.py's docstring).

Building on the device (llama_cpp_peer.py `build`) costs its scarce minutes; this VM has a CUDA 13 compiler without a
GPU, cuBLAS or driver library. So: llama.cpp as the package index's llama-cpp-python sdist vendors it (the same
source as `stage`), a toolkit root assembled beside the system's (its compiler copied, its libraries linked) with the
package index's cuBLAS 13 wheel's headers and libraries, and a driver library stub (libcuda.so.1's soname, the
driver functions ggml calls as functions that do nothing: the tools link against it, and on the device its driver
library is loaded in its place). ggml statically linked into each tool
(BUILD_SHARED_LIBS=OFF), no host-CPU tuning (GGML_NATIVE=OFF: the device's CPU is another), CUDA code for one
architecture (sm_90: the H200). `pack` puts the two tools with the CUDA runtime and OpenMP libraries they load into a
tarball; cuBLAS (600 MB) is the device's own (its PyTorch's cu13 wheels), found at run time by llama_cpp_peer.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from llama_cpp_peer import CMAKE_OPTIONS, SDIST, TARGETS, _pieces  # noqa: E402

# (beside the staged wheels; a new session's checkout starts without .devwheels, so the build and `pack` run in the
# session that carries the pieces to the device)
HERE = Path(os.environ.get("LCP_PREBUILD_DIR", str(ROOT / ".devwheels" / "lcp_prebuild")))
SYSTEM_CUDA = Path("/usr/local/cuda")
TARBALL = "llama-bin.tar.gz"  # llama_cpp_peer.py `unpack` extracts it into WORK/build/bin
RUNTIME_LIBS = ("libcudart.so.13", "libgomp.so.1")


def _fetch(into: Path) -> tuple[Path, Path]:
    """(the vendored llama.cpp source, the cuBLAS wheel's nvidia/cu13 folder), downloaded once."""
    source, cublas = into / "llama.cpp", into / "cublas" / "nvidia" / "cu13"
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into)]
    if not source.exists():
        subprocess.run(pip + ["--no-binary", ":all:", SDIST], check=True)
        sdist = next(into.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as t:
            members = [m for m in t.getmembers() if "/vendor/llama.cpp/" in m.name]
            t.extractall(into / "sdist", members=members, filter="data")
        shutil.move(next((into / "sdist").glob("*/vendor/llama.cpp")), source)
        shutil.rmtree(into / "sdist")
        sdist.unlink()
    if not cublas.exists():
        subprocess.run(pip + ["nvidia-cublas>=13,<14"], check=True)
        wheel = next(into.glob("nvidia_cublas-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(into / "cublas", [n for n in z.namelist() if "/include/" in n or ".so" in n])
        wheel.unlink()
    return source, cublas


def _toolkit(into: Path, cublas: Path) -> Path:
    """A CUDA root: the system's, its compiler copied (nvcc finds its headers and libraries from where it lies), its
    other folders linked, cuBLAS's headers and libraries added, and a libcuda stub."""
    root = into / "cuda"
    if root.exists():
        return root
    system = SYSTEM_CUDA.resolve()
    if not (system / "bin" / "nvcc").exists():
        raise SystemExit(f"no CUDA compiler at {system}")
    root.mkdir(parents=True)
    shutil.copytree(system / "bin", root / "bin", symlinks=False)
    for name in ("nvvm", "dist-info"):
        if (system / name).exists():
            (root / name).symlink_to(system / name)
    for name in ("include", "lib"):
        (root / name).mkdir()
        for f in (system / name).iterdir():
            (root / name / f.name).symlink_to(f)
    (root / "lib64").symlink_to("lib")
    (root / "targets" / "x86_64-linux").mkdir(parents=True)
    for name in ("include", "lib"):
        (root / "targets" / "x86_64-linux" / name).symlink_to(f"../../{name}")
    for f in (cublas / "include").glob("*.h"):
        (root / "include" / f.name).symlink_to(f)
    for f in (cublas / "lib").glob("libcublas*.so.*"):
        (root / "lib" / f.name).symlink_to(f)
        (root / "lib" / f.name.split(".so.")[0]).with_suffix(".so").symlink_to(f.name)
    driver_stub(root, [])
    return root


def driver_stub(root: Path, symbols: list[str]) -> Path:
    """root/lib/stubs/libcuda.so: `symbols` as functions that do nothing, under the driver's soname (libcuda.so.1),
    so that the tools link; at run time the device's driver library stands in its place."""
    stub = root / "lib" / "stubs"
    stub.mkdir(exist_ok=True)
    source = stub / "libcuda_stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in symbols))
    subprocess.run(
        ["gcc", "-shared", "-o", str(stub / "libcuda.so"), "-Wl,-soname,libcuda.so.1", str(source)], check=True
    )
    return stub / "libcuda.so"


def driver_symbols(archive: Path) -> list[str]:
    """The driver functions (cuXxx) a static library calls, which the tools then call themselves."""
    listed = subprocess.run(["nm", "-u", "--format=posix", str(archive)], capture_output=True, text=True).stdout
    return sorted({line.split()[0] for line in listed.splitlines() if re.match(r"cu[A-Z]", line)})


def configure(source: Path, root: Path, out: Path, arch: str, env: dict) -> None:
    command = ["cmake", "-S", str(source), "-B", str(out), "-G", "Ninja", *CMAKE_OPTIONS]
    command += [f"-DCMAKE_CUDA_COMPILER={root / 'bin' / 'nvcc'}", f"-DCUDAToolkit_ROOT={root}"]
    command += [f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF"]
    command += ["-DLLAMA_CURL=OFF", "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined"]
    subprocess.run(command, check=True, env=env)


def build(arch: str, jobs: int) -> Path:
    HERE.mkdir(parents=True, exist_ok=True)
    source, cublas = _fetch(HERE)
    root = _toolkit(HERE, cublas)
    out = HERE / "build"
    env = dict(os.environ, PATH=f"{root / 'bin'}:{os.environ['PATH']}", CUDA_PATH=str(root))
    if not (out / "build.ninja").exists():
        configure(source, root, out, arch, env)
    start = time.perf_counter()
    build = ["cmake", "--build", str(out), "-j", str(jobs), "--target"]
    subprocess.run(build + ["ggml-cuda"], check=True, env=env)  # (its driver calls: the stub's symbols)
    driver_stub(root, driver_symbols(out / "ggml" / "src" / "ggml-cuda" / "libggml-cuda.a"))
    subprocess.run(build + list(TARGETS), check=True, env=env)
    print(f"built {', '.join(TARGETS)} for sm_{arch} in {time.perf_counter() - start:.0f} s: {out / 'bin'}")
    return out / "bin"


def _system_library(name: str) -> Path:
    """A library as this machine's loader finds it (the CUDA runtime from the toolkit)."""
    for d in (SYSTEM_CUDA / "lib", SYSTEM_CUDA / "lib64", Path("/usr/lib/x86_64-linux-gnu"), Path("/lib64")):
        if (d / name).exists():
            return (d / name).resolve()
    raise SystemExit(f"{name} not found here")


def pack(bin_dir: Path, dest: Path) -> list[Path]:
    """The tools and the runtime libraries they load as llama-bin.tar.gz, in pieces of at most llama_cpp_peer's CHUNK,
    one piece a folder (.devwheels/lcp_bin_1, _2, ...: one device call carries one folder)."""
    missing = [t for t in TARGETS if not (bin_dir / t).exists()]
    if missing:
        raise SystemExit(f"not built yet: {', '.join(missing)} (run `build`)")
    for old in dest.glob("lcp_bin*"):
        shutil.rmtree(old)
    work = dest / "lcp_bin_tmp"
    work.mkdir(parents=True)
    with tarfile.open(work / TARBALL, "w:gz") as t:
        for tool in TARGETS:
            t.add(bin_dir / tool, arcname=tool)
        for lib in RUNTIME_LIBS:
            t.add(_system_library(lib), arcname=lib)
    folders = []
    for i, piece in enumerate(_pieces([work / TARBALL], work), 1):
        folder = dest / f"lcp_bin_{i}"
        folder.mkdir()
        piece.rename(folder / piece.name)
        folders.append(folder)
        print(f"{folder}: {piece.name}, {(folder / piece.name).stat().st_size / 2**20:.1f} MiB")
    work.rmdir()
    return folders


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--arch", default="90", help="CUDA architecture (90: the H200)")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    k = sub.add_parser("pack")
    k.add_argument("--bin", type=Path, default=HERE / "build" / "bin")
    k.add_argument("--dest", type=Path, default=ROOT / ".devwheels")
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.arch, args.jobs)
    else:
        pack(args.bin, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
