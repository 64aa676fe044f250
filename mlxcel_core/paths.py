"""Where mlxcel keeps its files: `MLXCEL_CACHE_DIR`, else the platform's user cache dir."""

import functools
import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    from . import settings

    env = settings.get("MLXCEL_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlxcel"))


def models_dir() -> Path:
    return cache_dir() / "models"


PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
DRIVER_CACHE_ENV = "CUDA_CACHE_PATH"


def driver_cache_dir() -> Path:
    return cache_dir() / "kernels" / "cuda-driver"


def keep_driver_cache() -> None:
    """Unless CUDA_CACHE_PATH is set, point the CUDA driver's JIT cache (the PTX it compiles for this GPU: MLX's own
    shipped kernels) beside the kernel cache, instead of ~/.nv, which a fresh container loses: an empty one adds
    seconds to a process's start. The driver reads the variable when
    CUDA initializes, so mlxcel_core sets it on import, before mlx (the directory is made by use_kernel_cache)."""
    if not os.environ.get(DRIVER_CACHE_ENV):
        os.environ[DRIVER_CACHE_ENV] = str(driver_cache_dir())


def use_kernel_cache() -> Path | None:
    """Point MLX's kernel cache (the CUDA kernels it compiles of its own; kernels/cubin_cache.py keeps ours there)
    into the cache dir and return it:
    MLX_PTX_CACHE_DIR as set, else, on a CUDA device, cache_dir()/kernels/mlx-<version>/<architecture>-<device>;
    None on other backends (nothing to keep). MLX itself reads a directory of this process's inside it
    (`mlx_kernel_dir`), set in the environment here, before MLX's first compile reads it.

    MLX's own default, /tmp/mlx/<version>/ptx, is lost with /tmp: every fresh machine or container then compiles
    again before its first token (about 70 s for an 8B 4-bit model on the H200, mlx-lm 6 s). MLX names its cache
    files by kernel module, not by GPU (jit_module.cpp, read_cached_ptx), so one directory per GPU."""
    import mlx.core as mx

    if os.environ.get(PTX_CACHE_ENV):
        path = Path(os.environ[PTX_CACHE_ENV])
        if path.name.startswith(AHEAD_PREFIX):  # (a compiling helper's own, in its parent's: mlx_jit_ahead.py)
            parent = path.parent
            return parent.parent if parent.name.startswith(PRIVATE_PREFIX) else parent
        if path.name.startswith(PRIVATE_PREFIX):  # this process's, or one inherited from the process that began it
            if path.name == _private_name():
                return path.parent
            path = path.parent
        if _cuda_available():
            _enter_private(path)
        return path
    if not _cuda_available():
        return None
    info = mx.device_info()
    device = f"{info.get('architecture', '')}-{info.get('device_name', '')}"
    path = (
        cache_dir()
        / "kernels"
        / f"mlx-{mx.__version__}"
        / "".join(c if c.isalnum() or c in "._-" else "_" for c in device)
    )
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.environ.get(DRIVER_CACHE_ENV) == str(driver_cache_dir()):
            driver_cache_dir().mkdir(exist_ok=True)
    except OSError:
        return None  # not writable: MLX's default (where MLX cannot create its directory it keeps nothing at all)
    _enter_private(path)
    return path


def _cuda_available() -> bool:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)  # (not in every build)
    return cuda is not None and cuda.is_available()


def mlx_kernel_dir() -> Path | None:
    """The directory MLX reads and writes its compiled kernels in (this process's private one where it has one);
    None without a kernel cache."""
    if use_kernel_cache() is None:
        return None
    return Path(os.environ[PTX_CACHE_ENV])


# MLX writes a module's files in place (jit_module.cpp, write_cached_ptx: the cubin, then its kernel-name list) and
# reads any module whose cubin exists, so a process sharing the directory with another that is compiling the same
# module can read it half written: "Failed to load compiled ... kernel" or "There is no kernel named ...". Processes
# that start together on an empty cache do (tensor-parallel ranks on one host, the test suite's workers). So each
# process's MLX gets a directory of its own, `.proc-<host>-<pid>` inside the shared one, holding hard links to the
# shared modules at its start; the modules it compiles are published into the shared directory by rename
# (`publish_kernels`: after a warm-up, and at exit), each module's cubin last, so a reader there finds no module or a
# whole one.
PRIVATE_PREFIX = ".proc-"
AHEAD_PREFIX = ".ahead-"
MODULE_SUFFIXES = (".cu", ".txt", ".ptx")  # (the order a module is moved in: its cubin, what MLX looks for, last)


def _enter_private(shared: Path) -> None:
    """Make this process's directory in `shared`, link the shared modules into it and point MLX at it; where that
    fails, MLX is pointed at `shared` itself."""
    import atexit

    private = shared / _private_name()
    try:
        _sweep_private(shared)
        private.mkdir(parents=True, exist_ok=True)
        _take(shared, private, copy=False)
    except OSError:
        shutil.rmtree(private, ignore_errors=True)
        os.environ[PTX_CACHE_ENV] = str(shared)
        return
    os.environ[PTX_CACHE_ENV] = str(private)
    atexit.register(_leave_private, private, shared)


def publish_kernels() -> int:
    """Publish the modules this process's MLX compiled into the shared kernel cache (`_enter_private`); how many. Call
    it where no compile is under way on another thread (a warm-up's end); exit calls it as well."""
    private = _own_private()
    return 0 if private is None else _publish(private, private.parent)


def adopt_kernels() -> int:
    """Copy into this process's directory the modules other processes published since it began; how many. MLX reads
    a module's files when it first needs the module, so a long-lived process (a test-suite worker) then compiles
    none that another has. Copies, each renamed in whole: MLX may be compiling the same module here (in place)."""
    private = _own_private()
    try:
        return 0 if private is None else _take(private.parent, private, copy=True)
    except OSError:  # (a full disk: MLX compiles what it lacks)
        return 0


def _own_private() -> Path | None:
    private = Path(os.environ.get(PTX_CACHE_ENV, ""))
    return private if private.name == _private_name() else None


def _take(shared: Path, private: Path, copy: bool) -> int:
    """Link (at the start, before MLX reads anything) or copy the shared modules `private` lacks into it; how many."""
    taken = 0
    for module in _modules(shared):
        if (private / module).exists():
            continue
        (private / module).parent.mkdir(parents=True, exist_ok=True)
        for part in (module.with_suffix(".txt"), module):  # (the cubin last: what MLX looks for)
            if not (shared / part).exists():
                continue
            if copy:
                temporary = (private / part).with_name(f".tmp-{part.name}")
                shutil.copyfile(shared / part, temporary)
                os.replace(temporary, private / part)
            elif not (private / part).exists():
                os.link(shared / part, private / part)
        taken += 1
    return taken


def _publish(private: Path, shared: Path) -> int:
    published = 0
    for module in _modules(private):
        if (shared / module).exists():
            continue
        try:
            (shared / module).parent.mkdir(parents=True, exist_ok=True)
            for part in (module.with_suffix(suffix) for suffix in MODULE_SUFFIXES):
                if (private / part).exists():
                    temporary = (shared / part).with_name(f".tmp-{os.getpid()}-{part.name}")
                    temporary.unlink(missing_ok=True)
                    try:
                        os.link(private / part, temporary)
                    except OSError:  # (a file system without hard links)
                        shutil.copyfile(private / part, temporary)
                    os.replace(temporary, shared / part)
            published += 1
        except OSError:
            pass  # (a full or read-only disk: the next process compiles it again)
    return published


def _modules(root: Path) -> list[Path]:
    """MLX's modules under `root`, as paths of their cubins relative to it (MLX splits a long module name into
    folders), leaving out processes' own directories."""
    found = []
    for cubin in root.rglob("*.ptx"):
        module = cubin.relative_to(root)
        if not any(part.startswith(".") for part in module.parts):
            found.append(module)
    return found


def _leave_private(private: Path, shared: Path) -> None:
    if private.is_dir():
        _publish(private, shared)
        shutil.rmtree(private, ignore_errors=True)


def _private_name() -> str:
    """This process's directory's name: .proc-<host>-<pid>."""
    return f"{PRIVATE_PREFIX}{_host()}-{os.getpid()}"


@functools.cache
def _host() -> str:
    import socket

    return "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname())


def _sweep_private(shared: Path) -> None:
    """Remove the private directories of processes that ended without leaving theirs (killed): a module there may be
    half written, so none is published."""
    host = _private_name().rsplit("-", 1)[0]  # (a process of another host or container may hold the same number)
    for private in shared.glob(f"{host}-*"):
        if ended(private.name.rsplit("-", 1)[1]):
            shutil.rmtree(private, ignore_errors=True)
    for temporary in shared.glob(".tmp-*-*"):  # (a publishing process's, killed between its link and rename)
        if ended(temporary.name.split("-")[1]):
            temporary.unlink(missing_ok=True)


def ended(pid: str) -> bool:
    """Whether `pid` (a process number as text in a file name) names another process of this host that has ended."""
    return pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        return True
    return True
