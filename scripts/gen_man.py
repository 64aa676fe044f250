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
from mlxcel_core import settings  # noqa: E402

ENVIRONMENT = [(s.name, s.help) for s in settings.SETTINGS] + list(settings.FOREIGN)
EXIT_STATUS = [
    ("0", "Success."),
    ("1", "Runtime failure (model load, generation or backend error)."),
    ("2", "Usage or input error (bad option or value, no or empty prompt, model missing, unsupported or corrupt)."),
    ("130", "Interrupted (Ctrl-C)."),
]


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
    synopsis = " ".join(
        f"\\fI{esc(p)}\\fR" if p.isupper() or p.startswith("[") else esc(p) for p in cmd.collect_usage_pieces(ctx)
    )
    out = [
        f'.TH {esc("-".join(path).upper())} 1 "" "mlxcel {esc(__version__)}" "User Commands"',
        *section("NAME", f"{esc('-'.join(path))} \\- {esc(summary)}"),
        *section("SYNOPSIS", f"\\fB{esc(name)}\\fR {synopsis}"),
        *section("DESCRIPTION", "\n.PP\n".join(paragraphs(cmd.help) or [esc(summary) + "."])),
    ]
    params = [p for p in cmd.get_params(ctx) if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    if arguments:
        out += section(
            "ARGUMENTS",
            *(
                f".TP\n\\fI{esc(p.make_metavar(ctx))}\\fR\n"
                + "\n.IP\n".join(paragraphs(getattr(p, "help", None)) or [""])
                for p in arguments
            ),
        )
    out += section("OPTIONS", *(option_entry(p, ctx) for p in params if p.param_type_name == "option"))
    subcommands = {n: c for n, c in sorted(getattr(cmd, "commands", {}).items()) if not c.hidden}
    if subcommands:
        out += section(
            "COMMANDS",
            *(
                f".TP\n\\fB{esc(n)}\\fR\n{esc(c.get_short_help_str(limit=200))}\n"
                f"See \\fB{esc('-'.join([*path, n]))}\\fR(1)."
                for n, c in subcommands.items()
            ),
        )
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
    changes = [
        (("stale" if check else "updated") if n in on_disk else ("missing" if check else "created"), n)
        for n in sorted(pages)
        if on_disk.get(n) != pages[n]
    ]
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
