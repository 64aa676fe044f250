"""`mlxcel convert`: a Hugging Face checkpoint or a GGUF file -> an MLX directory (mlx-lm's layout)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from .completion import complete_model
from .errors import reported_errors
from .progress_line import hub_download_bars


def _stderr(message: str) -> None:
    print(f"mlxcel: {message}", file=sys.stderr)


def convert(
    source: Annotated[
        str,
        typer.Argument(
            metavar="SRC",
            help="A Hugging Face model directory, a .gguf file, a Hub repo id (downloaded) or a catalogue name.",
            autocompletion=complete_model,
        ),
    ],
    out: Annotated[str, typer.Option("-o", "--out", help="The MLX directory to write (must not exist).")],
    quantize: Annotated[bool, typer.Option("-q", "--quantize", help="Quantize (affine, as mlx-lm does).")] = False,
    q_bits: Annotated[int, typer.Option("--q-bits", help="Bits per weight: 2, 3, 4, 5, 6 or 8.")] = 4,
    q_group_size: Annotated[int, typer.Option("--q-group-size", help="Quantization group size: 32, 64 or 128.")] = 64,
    q_recipe: Annotated[
        Optional[str],
        typer.Option(
            "--q-recipe",
            help="Mixed bits (mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6: low_high): embeddings, lm_head and mlx-lm's "
            "choice of v_proj/down_proj layers at the high bits, the rest at the low. Overrides --q-bits.",
        ),
    ] = None,
    dequantize: Annotated[bool, typer.Option("--dequantize", help="Write a quantized source as floats.")] = False,
    dtype: Annotated[
        Optional[str],
        typer.Option("--dtype", help="float16, bfloat16 or float32 for the float weights (default: config.json's)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT (a file or model directory).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object describing the result.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Tracebacks on errors.")] = False,
) -> None:
    """Convert a model to an MLX directory that mlxcel and mlx-lm load: model.safetensors shards (5 GB at most),
    config.json with mlx-lm's `quantization` key, the tokenizer (copied, or written from a GGUF's vocabulary with
    its chat template). Optionally quantized (-q, --q-bits, --q-group-size, --q-recipe), dequantized
    (--dequantize) or cast (--dtype). Progress goes to stderr (not with --json)."""
    with reported_errors(verbose):
        from mlxcel_core.convert import ConvertOptions
        from mlxcel_core.convert import convert as convert_model

        options = ConvertOptions(
            quantize=quantize,
            bits=q_bits,
            group_size=q_group_size,
            recipe=q_recipe,
            dequantize=dequantize,
            dtype=dtype,
            force=force,
        )
        hub_download_bars(json_out)
        result = convert_model(source, out, options, log=(lambda _: None) if json_out else _stderr)
        summary = {
            "path": str(result.path),
            "source": result.source,
            "quantization": result.quantization,
            "size_bytes": result.size_bytes,
            "parameters": result.parameters,
        }
        if json_out:
            print(json.dumps(summary))
            return
        quant = result.quantization
        what = "not quantized" if quant is None else f"{quant['bits']}-bit, group size {quant['group_size']}"
        if quant is not None and len(quant) > 3:
            what = f"mixed bits ({q_recipe or 'per layer'}), group size {quant['group_size']}"
        _stderr(f"wrote {result.path} ({result.size_bytes / 1e6:.1f} MB of weights, {what})")
