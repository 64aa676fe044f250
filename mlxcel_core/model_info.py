"""`mlxcel show`: what a model on disk is, read from config.json and the safetensors headers or from the GGUF header
and tensor table. No weight is read and no MLX is imported.

Parameters are counted from the stored tensors: MLX-quantized weights (uint32 words packing 32/bits values; their
`scales`/`biases` are not parameters) and MXFP4 blocks (two values a byte; their scales are not parameters) count
the values they hold; everything else its elements. A tied output head is stored once and counted once.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from .errors import CorruptModelError

_LICENSE_FILE = re.compile(r"^(licen[cs]e|use_policy|notice)(\.[a-z]+)?$", re.I)


def describe(source) -> dict[str, Any]:
    """The facts `mlxcel show` prints for a ModelSource (loading/resolve.py)."""
    info = _gguf(source.path) if source.kind == "gguf" else _hf_dir(source.path)
    info["path"] = str(source.path)
    info["origin"] = source.origin
    return info


def _hf_dir(path: Path) -> dict[str, Any]:
    config = _json(path / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    quant = config.get("quantization") or config.get("quantization_config")
    files = sorted(path.glob("*.safetensors"))
    tok = _json(path / "tokenizer_config.json")
    return {
        "format": "mlx" if config.get("quantization") else "safetensors",
        "architecture": config.get("model_type") or text.get("model_type"),
        "architectures": config.get("architectures") or [],
        "parameters": _safetensors_parameters(files, config.get("quantization") or {}),
        "context_length": config.get("max_position_embeddings") or text.get("max_position_embeddings"),
        "quantization": _hf_quantization(config, quant),
        "chat_template": bool(tok.get("chat_template"))
        or any((path / n).is_file() for n in ("chat_template.jinja", "chat_template.json")),
        "license": _license(path),
        "size": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
    }


def _hf_quantization(config: dict, quant) -> str:
    if isinstance(quant, dict) and "bits" in quant:
        mode = quant.get("mode", "affine")
        return f"MLX {quant['bits']}-bit ({mode}, group {quant.get('group_size', 64)})"
    if isinstance(quant, dict) and quant.get("quant_method"):
        return str(quant["quant_method"])
    dtype = config.get("torch_dtype") or config.get("dtype")
    return f"none ({dtype})" if dtype else "none"


def _safetensors_parameters(files: list[Path], quant: dict) -> int | None:
    if not files:
        return None
    headers = {}
    for f in files:
        headers.update(_safetensors_header(f))
    headers.pop("__metadata__", None)
    total = 0
    for name, meta in headers.items():
        count = 1
        for dim in meta["shape"]:
            count *= dim
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{base}.weight" in headers:
            continue  # an MLX-quantized layer's scales and biases
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in headers:
            continue  # MXFP4 block scales
        if f"{base}.scales" in headers and meta["dtype"] == "U32":
            layer = quant.get(base) if isinstance(quant.get(base), dict) else quant
            count = count * 32 // int(layer.get("bits", 4))
        elif name.endswith("_blocks") and meta["dtype"] == "U8":
            count *= 2
        total += count
    return total


def _safetensors_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise CorruptModelError(f"{path}: not a readable safetensors file ({exc})") from None


def _gguf(path: Path) -> dict[str, Any]:
    from gguf import LlamaFileType

    from .loading.gguf_header import read_header

    try:
        meta, tensors = read_header(path)  # (the header only: tensor data stays mapped, unread)
    except (ValueError, OSError) as exc:
        raise CorruptModelError(f"{path}: unreadable GGUF file ({exc})") from None
    arch = meta.get("general.architecture")
    types: dict[str, int] = {}
    for t in tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    file_type = meta.get("general.file_type")
    try:
        label = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        label = f"file type {file_type}"
    mix = ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1]))
    return {
        "format": "gguf",
        "architecture": arch,
        "architectures": [],
        "parameters": sum(int(t.n_elements) for t in tensors),
        "context_length": meta.get(f"{arch}.context_length"),
        "quantization": f"{label} (tensors: {mix})" if label else f"tensors: {mix}",
        "chat_template": bool(meta.get("tokenizer.chat_template")),
        "license": meta.get("general.license") or _license(path.parent),
        "size": path.stat().st_size,
    }


def _license(path: Path) -> str | None:
    """A license file beside the model, else the `license:` of the model card's front matter."""
    for f in sorted(path.iterdir()):
        if _LICENSE_FILE.match(f.name):
            return f.name
    card = path / "README.md"
    if card.is_file():
        head = card.read_text(errors="replace").split("\n---", 1)[0]
        match = re.search(r"^license:\s*(\S+)", head, re.M)
        if head.startswith("---") and match:
            return f"{match.group(1)} (model card)"
    return None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{path}: not readable JSON ({exc})") from None
    return data if isinstance(data, dict) else {}
