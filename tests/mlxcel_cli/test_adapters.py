"""`--adapter-path`: mlx-lm LoRA/DoRA adapters (random lora_a/lora_b written in the trainer's format) fused at load.

The reference is computed here independently: the merged weights in numpy (W + scale * B^T A^T for a linear layer,
W + scale * A B for an embedding, DoRA's rows rescaled to norm m) saved as a plain checkpoint. `mlxcel generate
--adapter-path` must give that checkpoint's greedy tokens, and the fused model its logits; mlx-lm's own
`load(path, adapter_path=...)` (unfused LoRA layers), where importable, the same logits.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from family_checks import SPECIAL, TEXT, cli_tokens
from parity import load_quiet, logits, mlx_lm_model, prompt_ids
from safetensors.numpy import load_file, save_file
from tiny_models import save_tiny_llama

from mlxcel_cli.main import main
from mlxcel_core.loading import load_model

RANK, SCALE = 4, 2.0
KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj", "lm_head", "model.embed_tokens"]
STEPS = 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("adapter-base"))


def _targets(num_layers: int, n_layers: int = 2) -> list[str]:
    """What mlx-lm adapts for KEYS: the layer keys in the last `num_layers` layers, and the top-level keys."""
    layers = range(n_layers - num_layers, n_layers)
    inner = [f"model.layers.{i}.{k}" for i in layers for k in KEYS if "." in k and not k.startswith("model.")]
    return inner + ["lm_head", "model.embed_tokens"]


def write_adapter(directory, weights, kind="lora", num_layers=1, seed=0):
    """adapter_config.json + adapters.safetensors as mlx-lm's trainer writes them; random A, B (and m for DoRA)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for path in _targets(num_layers):
        w = weights[f"{path}.weight"]
        rows, cols = w.shape
        embedding = path.endswith("embed_tokens")
        a_shape, b_shape = ((rows, RANK), (RANK, cols)) if embedding else ((cols, RANK), (RANK, rows))
        tensors[f"{path}.lora_a"] = rng.normal(0, 0.1, a_shape).astype(np.float32)
        tensors[f"{path}.lora_b"] = rng.normal(0, 0.1, b_shape).astype(np.float32)
        if kind == "dora":
            tensors[f"{path}.m"] = rng.uniform(0.5, 1.5, (rows,)).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "fine_tune_type": kind,
        "num_layers": num_layers,
        "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": KEYS},
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapters.safetensors"))
    return directory


def merged_checkpoint(base_dir, adapter_dir, out_dir, weights=None):
    """The adapted weights merged in numpy, saved beside a copy of the base's config and tokenizer."""
    weights = dict(load_file(str(base_dir / "model.safetensors")) if weights is None else weights)
    adapter = load_file(str(adapter_dir / "adapters.safetensors"))
    kind = json.loads((adapter_dir / "adapter_config.json").read_text())["fine_tune_type"]
    for name in [n for n in adapter if n.endswith(".lora_a")]:
        path = name.removesuffix(".lora_a")
        a, b, w = adapter[name], adapter[f"{path}.lora_b"], weights[f"{path}.weight"]
        merged = w + (SCALE * a @ b if path.endswith("embed_tokens") else SCALE * b.T @ a.T)
        if kind == "dora":
            merged = adapter[f"{path}.m"][:, None] * merged / np.linalg.norm(merged, axis=1, keepdims=True)
        weights[f"{path}.weight"] = merged.astype(np.float32)
    out_dir.mkdir()
    save_file(weights, str(out_dir / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def _mlx_lm_logits(model_dir, adapter_dir, prompt):
    model = mlx_lm_model(model_dir, adapter_path=str(adapter_dir))
    return np.array(model(mx.array([prompt])).astype(mx.float32))[0]


def _generate_with(path, adapter) -> list[int]:
    """`mlxcel generate --adapter-path` as family_checks.cli_tokens runs generate (raw prompt, specials suppressed)."""
    suppress = [arg for t in SPECIAL for arg in ("--suppress-token", str(t))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["generate", "-m", str(path), "-p", TEXT, "--no-chat-template", "--json", "-n", str(STEPS)]
            + suppress
            + ["--adapter-path", str(adapter)]
        )
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())["token_ids"]


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_fused_adapter_is_the_merged_model(base, kind, tmp_path):
    adapter = write_adapter(tmp_path / "adapter", load_file(str(base / "model.safetensors")), kind)
    merged = merged_checkpoint(base, adapter, tmp_path / "merged")
    want = cli_tokens(merged, steps=STEPS)["token_ids"]
    assert want != cli_tokens(base, steps=STEPS)["token_ids"]  # the adapter changes the model
    assert _generate_with(base, adapter) == want
    prompt = prompt_ids(24)
    fused = logits(load_model(str(base), log=lambda _: None, adapter_path=str(adapter)).model, prompt)
    np.testing.assert_allclose(fused, logits(load_quiet(merged).model, prompt), atol=1e-4, rtol=0)
    np.testing.assert_allclose(_mlx_lm_logits(base, adapter, prompt), fused, atol=1e-4, rtol=0)


def test_adapter_on_a_quantized_base(base, tmp_path, capsys):
    q4 = tmp_path / "q4"
    assert main(["convert", str(base), "-o", str(q4), "-q"]) == 0
    capsys.readouterr()
    quantized = load_quiet(q4).model
    from mlx.utils import tree_flatten

    from mlxcel_core.dequantize import dequantized_weight, is_quantized

    dequantized = {
        f"{name}.weight": np.array(dequantized_weight(m)) for name, m in quantized.named_modules() if is_quantized(m)
    }
    floats = {k: np.array(v) for k, v in tree_flatten(quantized.parameters()) if not k.endswith((".scales", ".biases"))}
    adapter = write_adapter(tmp_path / "adapter", {**floats, **dequantized})
    merged = merged_checkpoint(base, adapter, tmp_path / "merged", weights={**floats, **dequantized})
    messages = []
    fused = load_model(str(q4), log=messages.append, adapter_path=str(adapter)).model
    assert any("quantized layers dequantized to fuse exactly" in m for m in messages), messages
    assert fused.model.layers[0].self_attn.q_proj.bits == 4  # layers the adapter leaves alone stay quantized
    assert not is_quantized(fused.model.layers[1].self_attn.q_proj)
    prompt = prompt_ids(24)
    np.testing.assert_allclose(logits(fused, prompt), logits(load_quiet(merged).model, prompt), atol=1e-4, rtol=0)
    assert _generate_with(q4, adapter) == cli_tokens(merged, steps=STEPS)["token_ids"]
    np.testing.assert_allclose(_mlx_lm_logits(q4, adapter, prompt), logits(fused, prompt), atol=1e-4, rtol=0)


def test_run_and_serve_take_the_adapter(base, tmp_path, capsys):
    from servers import start_server

    adapter = write_adapter(tmp_path / "adapter", load_file(str(base / "model.safetensors")))
    merged = merged_checkpoint(base, adapter, tmp_path / "merged")
    args = ["-p", "The capital of France", "-n", str(STEPS), "--suppress-token", "0"]
    assert main(["run", str(base), "--adapter-path", str(adapter), *args]) == 0
    with_adapter = capsys.readouterr().out
    assert main(["run", str(merged), *args]) == 0
    assert with_adapter == capsys.readouterr().out
    assert main(["run", str(base), *args]) == 0
    assert with_adapter != capsys.readouterr().out
    assert main(["generate", "-m", str(merged), "--no-chat-template", "--json", *args]) == 0
    plain = json.loads(capsys.readouterr().out)
    server = start_server(base, adapter_path=str(adapter))
    try:
        with server.client() as client:
            body = {"prompt": "The capital of France", "max_tokens": STEPS, "temperature": 0, "logit_bias": {"0": -100}}
            got = client.post("/v1/completions", json=body, headers=server.auth_headers()).json()
        assert got["choices"][0]["text"] == plain["text"]
    finally:
        server.stop()


def _fails(capsys, args) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("mlxcel: error: "), (code, err)
    return err


def test_bad_adapters(base, tmp_path, capsys):
    weights = load_file(str(base / "model.safetensors"))
    gen = ["generate", "-m", str(base), "-p", "hi", "-n", "2", "--adapter-path"]
    assert "is not a directory" in _fails(capsys, [*gen, str(tmp_path / "missing")])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no adapter_config.json" in _fails(capsys, [*gen, str(empty)])
    broken = write_adapter(tmp_path / "broken", weights)
    (broken / "adapter_config.json").write_text("{not json")
    assert "is not valid JSON" in _fails(capsys, [*gen, str(broken)])
    alpha = write_adapter(tmp_path / "alpha", weights)
    config = json.loads((alpha / "adapter_config.json").read_text())
    config["lora_parameters"] = {"rank": RANK, "alpha": 16, "dropout": 0.0}
    (alpha / "adapter_config.json").write_text(json.dumps(config))
    assert "lora_parameters has no 'scale' (it has 'alpha'" in _fails(capsys, [*gen, str(alpha)])
    unknown = write_adapter(tmp_path / "unknown", weights)
    config = json.loads((unknown / "adapter_config.json").read_text())
    config["lora_parameters"]["keys"] = ["self_attn.q_proj", "self_attn.qkv"]
    (unknown / "adapter_config.json").write_text(json.dumps(config))
    assert "adapter key 'self_attn.qkv' matches no layer of the model" in _fails(capsys, [*gen, str(unknown)])
    other_layers = write_adapter(tmp_path / "other-layers", weights, num_layers=2)
    config = json.loads((other_layers / "adapter_config.json").read_text())
    config["num_layers"] = 1  # the file holds layer 0's tensors too
    (other_layers / "adapter_config.json").write_text(json.dumps(config))
    assert "model.layers.0." in _fails(capsys, [*gen, str(other_layers)])
    rank = write_adapter(tmp_path / "rank", weights)
    config = json.loads((rank / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = RANK + 1
    (rank / "adapter_config.json").write_text(json.dumps(config))
    assert "has shape" in _fails(capsys, [*gen, str(rank)])
    assert "--tp-size" in _fails(capsys, [*gen, str(rank), "--tp-size", "2"])


def test_bench_takes_the_adapter(base, tmp_path, capsys):
    adapter = write_adapter(tmp_path / "adapter", load_file(str(base / "model.safetensors")))
    fast = ["bench", "-p", "8", "-n", "4", "-r", "1", "-o", "json"]
    assert main([*fast, "-m", str(base), "--adapter-path", str(adapter)]) == 0
    captured = capsys.readouterr()
    assert [r["test"] for r in json.loads(captured.out)] == ["pp8", "tg4"]
    assert f"mlxcel: adapter {adapter}: lora fused into 5 layers" in captured.err
    assert "has no adapter_config.json" in _fails(capsys, [*fast, "-m", str(base), "--adapter-path", str(base)])
    assert "not to --model-shape" in _fails(capsys, [*fast, "--model-shape", "tiny", "--adapter-path", str(adapter)])
