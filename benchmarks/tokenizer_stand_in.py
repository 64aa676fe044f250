"""Write a checkpoint directory holding the default model's tokenizer beside a 1-layer random Llama of its
vocabulary, for `structured_outputs.py --model-shape ... --tokenizer-model DIR` on a machine that cannot download the
default model (the H200 of the device tool: its GGUF is over one call's 64 MiB, this directory ~10 MB).

    python benchmarks/tokenizer_stand_in.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcel_core.loading import load_model
    from mlxcel_core.loading.resolve import default_gguf_path
    from mlxcel_core.loading.shape_table import SHAPES
    from mlxcel_core.loading.shapes import build_random_model

    out = Path((argv or sys.argv[1:])[0])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_model(str(default_gguf_path()), log=lambda m: None).tokenizer
    tokenizer.backend.save(str(out / "tokenizer.json"))
    eos = [tokenizer.backend.id_to_token(i) for i in sorted(tokenizer.eos_token_ids)]
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos[0], "bos_token": None}))
    small = dict(vocab_size=tokenizer.vocab_size, num_hidden_layers=1, hidden_size=64, tie_word_embeddings=True)
    model, config = build_random_model("tiny", dtype="float16", config=dict(SHAPES["tiny"], **small))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    print(f"{out}: the default model's tokenizer ({tokenizer.vocab_size} ids, EOS {eos}) beside a 1-layer model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
