"""Output formats of `mlxcel bench`: markdown like llama-bench, json, jsonl and csv with llama-bench's field names."""

from __future__ import annotations

import csv
import io
import json
from typing import Sequence

from .bench import FIELDS, BenchResult, BenchTest, format_mean_std, human_count
from .errors import InputError

OUTPUT_FORMATS = ("md", "json", "jsonl", "csv")


# -- output -------------------------------------------------------------------------------------------------
class Formatter:
    """Streams results: `begin()`, then `row(result)` as each test finishes, then `end()` (strings to print)."""

    def begin(self) -> str:
        return ""

    def row(self, result: BenchResult) -> str:
        raise NotImplementedError

    def end(self) -> str:
        return ""


class MarkdownFormatter(Formatter):
    """llama-bench's table: model, size, params, backend, [b,] test, t/s; plus TTFT and peak memory."""

    def __init__(self, model: str, labels: Sequence[str], show_batch: bool):
        columns = [("model", max(30, len(model)), "<"), ("size", 10, ">"), ("params", 10, ">"), ("backend", 10, "<")]
        if show_batch:
            columns.append(("b", 3, ">"))
        columns += [
            ("test", max(15, *(len(label) for label in labels)) if labels else 15, ">"),
            ("t/s", 20, ">"),
            ("TTFT ms", 10, ">"),
            ("peak GB", 8, ">"),
        ]
        self.columns = columns

    def _line(self, cells: Sequence[str]) -> str:
        return "| " + " | ".join(f"{c:{align}{w}}" for c, (_, w, align) in zip(cells, self.columns)) + " |\n"

    def begin(self) -> str:
        rule = "| " + " | ".join(("-" * w if a == "<" else "-" * (w - 1) + ":") for _, w, a in self.columns) + " |\n"
        return self._line([name for name, _, _ in self.columns]) + rule

    def row(self, r: BenchResult) -> str:
        cells = [r.model, f"{r.model_size / 2**30:.2f} GiB", human_count(r.model_n_params), r.backend]
        if any(name == "b" for name, _, _ in self.columns):
            cells.append(str(r.test.n_batch))
        cells += [r.test.label, format_mean_std(r.avg_ts, r.stddev_ts), f"{r.ttft_ms:.2f}", f"{r.peak_memory_gb:.3f}"]
        return self._line(cells)


class JsonFormatter(Formatter):
    """A JSON list of objects, printed as results arrive (like llama-bench -o json)."""

    def __init__(self):
        self.count = 0

    def begin(self) -> str:
        return "["

    def row(self, r: BenchResult) -> str:
        self.count += 1
        text = json.dumps(r.to_dict(), ensure_ascii=False, indent=2)
        return ("," if self.count > 1 else "") + "\n" + "\n".join("  " + ln for ln in text.splitlines())

    def end(self) -> str:
        return "\n]\n"


class JsonlFormatter(Formatter):
    def row(self, r: BenchResult) -> str:
        return json.dumps(r.to_dict(), ensure_ascii=False) + "\n"


class CsvFormatter(Formatter):
    """Header, then one row per test; samples_ns / samples_ts are JSON lists in their cells."""

    def _csv(self, values) -> str:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow(values)
        return buffer.getvalue()

    def begin(self) -> str:
        return self._csv(FIELDS)

    def row(self, r: BenchResult) -> str:
        values = r.to_dict()
        return self._csv(
            [
                json.dumps(values[k]) if isinstance(values[k], list) else "" if values[k] is None else values[k]
                for k in FIELDS
            ]
        )


def formatter(name: str, model_description: str = "", tests: Sequence[BenchTest] = ()) -> Formatter:
    if name == "md":
        return MarkdownFormatter(model_description, [t.label for t in tests], any(t.n_batch != 1 for t in tests))
    if name == "json":
        return JsonFormatter()
    if name == "jsonl":
        return JsonlFormatter()
    if name == "csv":
        return CsvFormatter()
    raise InputError(f"-o/--output must be one of {', '.join(OUTPUT_FORMATS)}, got '{name}'")


def render(results: Sequence[BenchResult], name: str) -> str:
    """All results at once in one format (for scripts)."""
    tests = [r.test for r in results]
    fmt = formatter(name, results[0].model if results else "", tests)
    return fmt.begin() + "".join(fmt.row(r) for r in results) + fmt.end()
