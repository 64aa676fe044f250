"""Generate the man pages in man/ from the Typer app (one per command).

    python scripts/gen_man.py           # (re)write man/mlxcel.1 and man/mlxcel-<command>.1
    python scripts/gen_man.py --check   # exit 1 listing stale, missing or obsolete pages

Output is deterministic (no dates), so the pages can be committed and checked in CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent.parent
MAN_DIR = ROOT / "man"
sys.path.insert(0, str(ROOT))

from mlxcel_cli import __version__  # noqa: E402
from mlxcel_cli.main import app  # noqa: E402

ENVIRONMENT = [
    ("MLXCEL_CACHE_DIR", "Directory for mlxcel's files: downloaded and converted models (models/), autotuning "
                         "results (autotune/) and compiled CUDA kernels (kernels/). Default: the platform's user cache directory for \"mlxcel\" "
                         "(for example ~/.cache/mlxcel on Linux, ~/Library/Caches/mlxcel on macOS)."),
    ("HF_HUB_OFFLINE", "Set to 1 to never download from the Hugging Face Hub; "
                       "models must already be local or in the Hugging Face cache."),
    ("MLXCEL_COMPILE", "1: run each decode step as one compiled MLX graph (paged KV storage, and dense storage except "
                       "on CUDA); 0: build it op by op. Default: compiled when MLX runs on a GPU, op by op on CPU."),
    ("MLXCEL_FUSE", "1: compute a decode step's q/k/v and gate/up projections as one matmul each and, with the "
                    "4-bit kernel, each residual add inside its o_proj/down_proj launch; 0: one launch per layer "
                    "and op. Default: fused when MLX runs on a GPU."),
    ("MLXCEL_FUSE_NORM", "0: do not take each layer's RMSNorm into its fused q/k/v and gate/up kernel launches. "
                         "Default: taken there wherever those kernels run (4-bit, or 16-bit where MLXCEL_HMV "
                         "applies; CUDA only)."),
    ("MLXCEL_FUSE_ROPE", "0: do not apply RoPE to q and k inside the fused q/k/v launch. Default: applied there "
                         "wherever that kernel runs (plain non-traditional RoPE, no q/k norms)."),
    ("MLXCEL_HMV", "1: bf16/fp16 layers' decode matvecs (with their fused projections and residual adds) run mlxcel's "
                   "16-bit CUDA kernel; 0: MLX's. Default: the kernel for models up to 4096 wide, the widest "
                   "measured on an H200; CUDA only."),
    ("MLXCEL_KV_IN_KERNEL", "0: a decode step's keys and values go into the paged KV pools by scatter ops before "
                            "attention. Default: the CUDA paged-attention kernel writes them itself, in place (CUDA "
                            "only; elsewhere the scatter ops always run)."),
    ("MLXCEL_COMBINE_IN_KERNEL", "0: a paged decode step's attention splits are combined by a second kernel launch. "
                                 "Default: the last of the split kernel's blocks for each head group combines them, one "
                                 "launch a layer (CUDA only)."),
    ("MLX_PTX_CACHE_DIR", "MLX's own setting: where it keeps the CUDA kernels it compiles. Unless it is set, mlxcel "
                          "sets it to $MLXCEL_CACHE_DIR/kernels/mlx-VERSION/GPU, which outlives /tmp (MLX's default)."),
    ("CUDA_CACHE_PATH", "The CUDA driver's own setting: where it keeps the PTX it compiles for the GPU. Unless it is "
                        "set, mlxcel sets it to $MLXCEL_CACHE_DIR/kernels/cuda-driver (the driver's default, ~/.nv, is "
                        "lost with a fresh container)."),
    ("MLXCEL_CUBIN_CACHE", "0: mlxcel's CUDA kernels are compiled in every process (as mx.fast.cuda_kernel does). "
                           "Default: each is compiled once and kept as a cubin in the kernel cache directory above. "
                           "MLX hashes a kept cubin at each launch, so a small model's decode steps are slower from "
                           "cubins (13-28% at 1B on an H200); 0 trades that for a compile at the first request."),
    ("MLX_ENABLE_TF32", "MLX's own switch, which mlxcel sets to 0 unless it is set: float32 matmuls stay float32 on "
                        "CUDA instead of TF32 (1 trades that precision for speed; 16-bit and quantized models are "
                        "unaffected)."),
    ("MLXCEL_QMV", "1: 4-bit layers' decode matvecs run mlxcel's CUDA kernel; 0: MLX's quantized_matmul. "
                   "Default: 1 (CUDA only; elsewhere always MLX's), for decode batches of up to 8 sequences "
                   "(MLXCEL_QMV_MAX_ROWS=1..8 lowers that)."),
    ("MLXCEL_QMM_BATCH", "mma, mlx, matrix or chunks: how a 4-bit decode batch of more than 8 sequences is "
                         "computed on CUDA. mma (default): mlxcel's tensor-core kernel, 32 rows a launch; mlx: MLX's "
                         "quantized_matmul as the batch comes (MLX 0.32 reads the weights once per sequence); matrix: "
                         "MLX's, on the batch as one matrix; chunks: mlxcel's matvec kernel, 8 rows a launch."),
    ("MLXCEL_QMM_WIDE", "0: the tensor-core kernel loads its weights and inputs in 16-bit pieces instead of vectors "
                        "(default: vectors, 1.3x faster at an 8B 4-bit batch of 32 on the H200)."),
    ("MLXCEL_HMV_MAX_ROWS", "1..8: decode batches of up to this many sequences run the 16-bit kernel (MLXCEL_HMV), "
                            "larger ones MLX's matmul. Default by the model's width: 8 up to 2048 wide, else 2."),
    ("MLXCEL_PREFILL_BATCH", "N: up to N waiting prompts are prefilled whole in one forward (left-padded; paged KV "
                             "without --kv-bits) instead of one a step. Default: 8 on a GPU (a batch's time to first "
                             "token fell 1.5-5x on the H200), 1 on CPU (where it rose)."),
    ("MLXCEL_CUDA_GRAPH", "0: replay no decode step as a CUDA graph. Default on CUDA: while one greedy request decodes "
     "alone, its decode steps after the first are recorded once and replayed as one CUDA graph of mlxcel's kernels, "
     "with no MLX work a token; other steps run through MLX as before. Recordings are kept for later requests."),
    ("MLXCEL_GRAPH_PDL", "0: no programmatic dependent launch (default on sm_90 and newer GPUs: mlxcel's CUDA kernels "
     "wait for the previous kernel themselves, and a replayed decode graph lets each kernel start while the previous "
     "one finishes; 5% faster 1B 4-bit decode on the H200). 1 forces it."),
    ("MLXCEL_LAUNCH_THREAD", "1 (experimental, off by default: no clear win on the H200): hand each compiled paged "
                             "decode step to MLX on a launcher thread while the next one is built; tokens are read "
                             "two steps later instead of one."),
]
EXIT_STATUS = [("0", "Success."), ("1", "Runtime failure (model load, generation or backend error)."),
               ("2", "Usage or input error (bad option or value, no or empty prompt, model missing, unsupported or corrupt)."),
               ("130", "Interrupted (Ctrl-C).")]


def esc(text: str) -> str:
    """Escape plain text for groff: backslashes, hyphens as \\-, and control characters at line starts."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + ln if ln.startswith((".", "'")) else ln for ln in text.split("\n"))


def paragraphs(help_text: str | None) -> list[str]:
    """Help text as groff paragraphs (blank lines separate them; click's \\b markers are dropped)."""
    lines = [ln.strip() for ln in (help_text or "").strip().splitlines() if ln.strip() != "\b"]
    paras, cur = [], []
    for ln in lines + [""]:
        if ln:
            cur.append(ln)
        elif cur:
            paras.append(esc(" ".join(cur)))
            cur = []
    return paras


def default_text(param) -> str | None:
    value = param.default
    if value is None or value is False or callable(value) or (isinstance(value, (list, tuple)) and not value):
        return None
    if value is True and param.is_flag and param.secondary_opts:
        return param.opts[0]
    return ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _display_order(opt: str) -> tuple[int, str]:
    return len(opt) - len(opt.lstrip("-/+")), opt


def option_entry(param, ctx) -> str:
    # short spellings first, as --help shows them (this also fixes the order of the help option's set of names)
    spellings = [o for opts in (param.opts, param.secondary_opts) for o in sorted(opts, key=_display_order)]
    flags = ", ".join(f"\\fB{esc(o)}\\fR" for o in spellings)
    if not param.is_flag:
        flags += f" \\fI{esc(param.make_metavar(ctx))}\\fR"
    body = paragraphs(param.help) or [""]
    default = default_text(param)
    if default is not None:
        body[-1] = (body[-1] + " " if body[-1] else "") + f"Default: {esc(default)}."
    return "\n".join([".TP", flags, "\n.IP\n".join(body)])


def section(title: str, *lines: str) -> list[str]:
    return [f".SH {title}", *lines]


def render(path: list[str], cmd, ctx) -> str:
    name = " ".join(path)
    summary = (cmd.get_short_help_str(limit=200) or name).rstrip(".")
    synopsis = " ".join(f"\\fI{esc(p)}\\fR" if p.isupper() or p.startswith("[") else esc(p)
                        for p in cmd.collect_usage_pieces(ctx))
    out = [f'.TH {esc("-".join(path).upper())} 1 "" "mlxcel {esc(__version__)}" "User Commands"',
           *section("NAME", f"{esc('-'.join(path))} \\- {esc(summary)}"),
           *section("SYNOPSIS", f"\\fB{esc(name)}\\fR {synopsis}"),
           *section("DESCRIPTION", "\n.PP\n".join(paragraphs(cmd.help) or [esc(summary) + "."]))]
    params = [p for p in cmd.get_params(ctx) if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    if arguments:
        out += section("ARGUMENTS", *(f".TP\n\\fI{esc(p.make_metavar(ctx))}\\fR\n"
                                      + "\n.IP\n".join(paragraphs(getattr(p, "help", None)) or [""])
                                      for p in arguments))
    out += section("OPTIONS", *(option_entry(p, ctx) for p in params if p.param_type_name == "option"))
    subcommands = {n: c for n, c in sorted(getattr(cmd, "commands", {}).items()) if not c.hidden}
    if subcommands:
        out += section("COMMANDS", *(f".TP\n\\fB{esc(n)}\\fR\n{esc(c.get_short_help_str(limit=200))}\n"
                                     f"See \\fB{esc('-'.join([*path, n]))}\\fR(1)." for n, c in subcommands.items()))
    if len(path) == 1:
        out += section("ENVIRONMENT", *(f".TP\n.B {var}\n{esc(text)}" for var, text in ENVIRONMENT))
    out += section("EXIT STATUS", *(f".TP\n.B {code}\n{esc(text)}" for code, text in EXIT_STATUS))
    parent = ["-".join(path[:-1])] if len(path) > 1 else []
    see_also = parent + ["-".join([*path, n]) for n in subcommands]
    if see_also:
        out += section("SEE ALSO", ",\n".join(f".BR {esc(p)} (1)" for p in see_also))
    return "\n".join(out) + "\n"


def render_pages() -> dict[str, str]:
    """Every man page the app should have: {"mlxcel.1": text, "mlxcel-generate.1": text, ...}."""
    pages: dict[str, str] = {}

    def walk(path: list[str], cmd, parent) -> None:
        ctx = cmd.context_class(cmd, info_name=path[-1], parent=parent, **cmd.context_settings)
        pages["-".join(path) + ".1"] = render(path, cmd, ctx)
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            if not sub.hidden:
                walk([*path, name], sub, ctx)

    walk(["mlxcel"], typer.main.get_command(app), None)
    return pages


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: python scripts/gen_man.py [--check]", file=sys.stderr)
        return 2
    check, pages = bool(argv), render_pages()
    on_disk = {p.name: p.read_text() for p in MAN_DIR.glob("mlxcel*.1")}
    changes = [(("stale" if check else "updated") if n in on_disk else ("missing" if check else "created"), n)
               for n in sorted(pages) if on_disk.get(n) != pages[n]]
    changes += [("obsolete" if check else "removed", n) for n in sorted(on_disk.keys() - pages.keys())]
    report = "".join(f"{what}: man/{name}\n" for what, name in changes)
    if check:
        if changes:
            print(report + "man pages are out of date: run `python scripts/gen_man.py`", file=sys.stderr)
        return 1 if changes else 0
    MAN_DIR.mkdir(exist_ok=True)
    for what, name in changes:
        if what == "removed":
            (MAN_DIR / name).unlink()
        else:
            (MAN_DIR / name).write_text(pages[name])
    print(report + f"{len(pages)} man pages in man/ ({len(changes)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
