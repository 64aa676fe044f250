"""`--adapter-path DIR` for generate, run, serve and bench: an mlx-lm LoRA/DoRA adapter fused at load."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

AdapterPath = Annotated[
    Optional[str],
    typer.Option(
        "--adapter-path",
        metavar="DIR",
        help="LoRA/DoRA adapter directory as mlx-lm's trainer writes it (adapter_config.json, adapters.safetensors), "
        "fused into the weights at load; quantized layers it adapts are dequantized to fuse exactly.",
    ),
]


def check_adapter(adapter_path: Optional[str], tp_size: int = 1) -> None:
    """Refuse --adapter-path with --tp-size > 1 before any rank starts (the ranks would load without it)."""
    if adapter_path is not None and tp_size > 1:
        from .errors import fail

        raise fail("--adapter-path cannot be combined with --tp-size > 1 (adapters are fused into unsharded weights)")
