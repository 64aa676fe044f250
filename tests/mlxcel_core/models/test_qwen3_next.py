"""Qwen3-Next: parity with transformers (gated delta-net layers with their recurrent state, gated full attention with
partial rotary, (1 + weight) norms, MoE with a gated shared expert) in both config styles, the engine's paths over
recurrent state (batched, paged, chunked prefill, prompts prefilled together), quantized copies, the CLI and the
server, and what the engine refuses or does not reuse for a model with recurrent layers."""

from __future__ import annotations

import json
import shutil

import family_checks
import numpy as np
import pytest
from parity import assert_parity, checkpoint_logits, load_quiet, load_unfused, prompt_ids, save_tiny_checkpoint
from recurrent_checks import generate
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from mlxcel_core.errors import InputError, UnsupportedModelError
from mlxcel_core.models.base import has_recurrent_layers

# Layers: linear, full, linear, full; layer 0's MLP dense (mlp_only_layers), the others MoE with a shared expert.
# Partial rotary 0.5 and rope_theta 1e6, so that both are read. Every prompt longer than 8 tokens crosses the engine
# checks' 8-token prefill chunks; the 64-token parity prompt crosses the delta rule's 64-position chunks.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    initializer_range=0.1,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
)


def condition(path, conv_scale: float = 4.0, seed: int = 0):
    """Random parameters where transformers initializes constants, at a scale where float32 noise stays small:
    (1 + weight) norms in [0.5, 1.5), the gated norms' weights in [0.5, 1.5), decays A = exp(A_log) in [0.5, 4),
    dt_bias in [-1, 1), and the convolutions scaled up so that the delta rule's outputs are not tiny next to the gated
    norm's eps (a tiny output normalized amplifies float32 rounding past the 1e-4 parity bound)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith("linear_attn.norm.weight"):
            weights[name] = rng.uniform(0.5, 1.5, w.shape).astype(w.dtype)
        elif name.endswith("norm.weight"):
            weights[name] = rng.uniform(-0.5, 0.5, w.shape).astype(w.dtype)
        elif name.endswith("A_log"):
            weights[name] = np.log(rng.uniform(0.5, 4.0, w.shape)).astype(w.dtype)
        elif name.endswith("dt_bias"):
            weights[name] = rng.uniform(-1.0, 1.0, w.shape).astype(w.dtype)
        elif name.endswith("conv1d.weight"):
            weights[name] = (w * conv_scale).astype(w.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def older_style(src, dst):
    """The released checkpoints' config.json: no layer_types (every full_attention_interval-th layer is full
    attention), rope_theta and partial_rotary_factor at the top level, rope_scaling null."""
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    types = config.pop("layer_types")
    assert types == ["linear_attention", "full_attention"] * 2
    config.update(
        full_attention_interval=2,
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        rope_scaling=None,
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), Qwen3NextConfig, Qwen3NextForCausalLM, **CONFIG)
    return condition(path)


def test_parity_with_transformers(tiny):
    assert_parity(tiny)


def test_parity_older_config_style(tiny, tmp_path):
    assert_parity(older_style(tiny, tmp_path / "older"))


def test_architecture_follows_config(tiny):
    model = load_unfused(tiny).model
    assert [layer.layer_type for layer in model.layers] == CONFIG["layer_types"]
    assert has_recurrent_layers(model)
    attn = model.layers[1].self_attn
    assert attn.q_proj.weight.shape == (2 * 4 * 32, 64) and attn.rope.dims == 16  # query + gate; half the head
    assert attn.rope.base == 1e6
    assert type(model.layers[0].mlp).__name__ == "GatedMLP"
    assert type(model.layers[2].mlp).__name__ == "SharedExpertMoe"
    assert model.kv_layout() == [None, (2, 32), None, (2, 32)]
    conv, delta = model.state_layout()[0]
    assert conv[0] == (3, 2 * 2 * 16 + 4 * 16) and delta[0] == (4, 16, 16)


def test_mlx_lm_layout_same_logits(tiny, tmp_path):
    """mlx-lm's conversion (experts stacked as switch_mlp, conv1d weights in MLX's [C, K, 1] layout, the (1 + weight)
    norms stored with the 1 added) loads to the same logits."""
    import mlx.core as mx

    from mlxcel_core.models.qwen3_next import SHIFTED_NORMS

    path = shutil.copytree(tiny, tmp_path / "mlx-lm")
    weights = mx.load(str(path / "model.safetensors"))
    for i in range(1, 4):
        prefix = f"model.layers.{i}.mlp"
        for name in ("gate_proj", "up_proj", "down_proj"):
            experts = [weights.pop(f"{prefix}.experts.{e}.{name}.weight") for e in range(4)]
            weights[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(experts)
    for name, value in weights.items():
        if name.endswith("conv1d.weight"):
            weights[name] = mx.moveaxis(value, 2, 1)
        elif name.endswith(SHIFTED_NORMS):
            weights[name] = value + 1
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    np.testing.assert_allclose(checkpoint_logits(path), checkpoint_logits(tiny), atol=1e-5, rtol=0)


def test_unknown_layer_type_is_refused():
    from mlxcel_core.models.qwen3_next import ModelArgs

    with pytest.raises(UnsupportedModelError, match="layer_types.*sliding_attention"):
        ModelArgs.from_dict({**CONFIG, "vocab_size": 320, "layer_types": ["sliding_attention"] * 4})


def test_engine_paths(tiny):
    family_checks.assert_engine_paths(tiny)


def test_compiled_paged_steps_carry_the_state(tiny):
    """Compiled paged decode steps take the state pool's arrays and the rows' slots as inputs: they run (no fallback
    to op by op) and give the op-by-op tokens, rows of different lengths joining and leaving the batch."""
    loaded = load_quiet(tiny)
    prompts = [prompt_ids(n, seed=n) for n in (5, 17, 30)]
    config = dict(max_batch_size=3, storage="paged", block_size=8)
    _, eager = generate(loaded, prompts, steps=[20, 9, 14], **config)
    engine, compiled = generate(loaded, prompts, steps=[20, 9, 14], **{**config, "compile_decode": True})
    assert compiled == eager
    assert engine.runner.compiled is not None and engine.runner.compiled.steps >= 19


def test_dense_chunked_prefill_equals_whole(tiny):
    """The dense caches carry the recurrent state from chunk to chunk as the paged state pool does."""
    loaded = load_quiet(tiny)
    prompt = prompt_ids(37, seed=3)
    _, whole = generate(loaded, [prompt], storage="dense")
    _, chunked = generate(loaded, [prompt], storage="dense", prefill_chunk_size=5)
    assert chunked == whole


def test_cancelled_and_finished_rows_free_their_state(tiny):
    loaded = load_quiet(tiny)
    prompts = [prompt_ids(n, seed=n) for n in (11, 5, 20)]
    engine, tokens = generate(
        loaded, prompts, max_batch_size=3, storage="paged", block_size=8, prefill_chunk_size=8, close_after=(6, 1)
    )
    pool = engine.storage.states
    assert pool.in_use == 0 and engine.storage.stats()["state_slots_used"] == 0
    assert engine.storage.pool.num_available() == engine.storage.pool.num_blocks
    assert len(tokens[0]) == len(tokens[2]) == 12 and len(tokens[1]) < 12
    _, alone = generate(loaded, [prompts[2]], storage="dense")
    assert tokens[2] == alone[0]  # the cancelled neighbour left the other rows' states alone


def test_a_row_admitted_where_one_was_cancelled_gets_its_slot(tiny):
    """Every slot held (max_batch_size rows) and a third prompt waiting: the step that drops a cancelled row admits
    the waiting one, whose state takes the freed slot; its tokens are its solo run's."""
    loaded = load_quiet(tiny)
    prompts = [prompt_ids(n, seed=n) for n in (9, 14, 6)]
    engine, tokens = generate(loaded, prompts, max_batch_size=2, storage="paged", block_size=8, close_after=(4, 0))
    assert engine.storage.states.num_slots == 2 and engine.storage.states.in_use == 0
    assert tokens[2] == generate(loaded, [prompts[2]], storage="dense")[1][0]


def test_a_repeated_prompt_starts_from_its_kept_state(tiny):
    """A cached prefix is reusable only with the state at its end: the paged storage keeps the state at the prompt's
    last block boundary (engine/state_snapshots.py), so a second identical prompt computes only the tokens after it
    and gives the same tokens."""
    loaded = load_quiet(tiny)
    prompt = prompt_ids(40, seed=5)
    engine, first = generate(loaded, [prompt], storage="paged", block_size=8, prefix_cache=True)
    computed = engine.runner.prefill_tokens
    from mlxcel_core.sampling import SamplingParams

    seq = engine.open(prompt, SamplingParams(max_tokens=12))
    second = []
    while engine.has_work():
        second += [out.token for out in engine.step() if out.token is not None]
    assert engine.sequence(seq).cached_tokens == 32
    assert engine.runner.prefill_tokens == computed + len(prompt) - 32 == 2 * len(prompt) - 32
    assert engine.storage.stats()["prefix_hits"] == 1
    assert second == first[0]


def test_conversation_reuses_the_state_of_a_whole_earlier_turn(tiny):
    """Dense storage keeps a chat's caches, recurrent state included: a turn that extends the previous one computes
    only what is new; one that diverges from it starts afresh (a state cannot be cut back). Both give the tokens of a
    fresh engine on the whole prompt."""
    from mlxcel_core.engine import Conversation, Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    loaded = load_quiet(tiny)
    loaded.tokenizer.eos_token_ids = set()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(storage="dense"))
    conversation = Conversation()

    def turn(prompt):
        seq = engine.open(prompt, SamplingParams(max_tokens=8), conversation)
        tokens = []
        while engine.has_work():
            tokens += [out.token for out in engine.step() if out.token is not None]
        return tokens, engine.sequence(seq).cached_tokens

    first, _ = turn(prompt_ids(20, seed=1))
    extended = conversation.tokens + prompt_ids(6, seed=2)
    second, cached = turn(extended)
    assert cached == len(extended) - 6 and second == generate(loaded, [extended], steps=8, storage="dense")[1][0]
    diverged = extended[:10] + prompt_ids(5, seed=4)
    third, cached = turn(diverged)
    assert cached == 0 and third == generate(loaded, [diverged], steps=8, storage="dense")[1][0]


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_speculative_decoding_gives_the_plain_output(tiny, storage):
    """Rejected draft tokens are taken back out of the recurrent state (engine/recurrent_rollback.py): the model
    drafting for itself and prompt lookup both give the plain greedy tokens."""
    from mlxcel_core.engine import SpeculativeConfig

    loaded = load_quiet(tiny)
    prompt = prompt_ids(15, seed=6)
    plain = generate(loaded, [prompt], steps=24, storage=storage, block_size=8)[1][0]
    for drafter in (dict(ngram=2), dict(draft_model=str(tiny))):
        spec = SpeculativeConfig(num_draft_tokens=3, **drafter)
        engine, tokens = generate(loaded, [prompt], steps=24, storage=storage, block_size=8, speculative=spec)
        assert tokens[0] == plain and engine.speculator.stats.rounds > 0


def test_kv_budget_counts_the_recurrent_state(tiny):
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.engine.budget import state_bytes_per_sequence, state_tokens_per_sequence
    from mlxcel_core.sampling import SamplingParams

    loaded = load_quiet(tiny)
    model = loaded.model
    # Per linear layer: 3 x 128 conv inputs (2 bytes each) + 4 x 16 x 16 float32 delta-rule state.
    assert state_bytes_per_sequence(model) == 2 * (3 * 128 * 2 + 4 * 16 * 16 * 4)
    state_tokens = state_tokens_per_sequence(model)
    assert state_tokens == -(-state_bytes_per_sequence(model) // (2 * 2 * 64 * 2))  # 2 KV layers x K,V x 64 x 2 B
    engine = Engine(model, loaded.tokenizer, EngineConfig(kv_budget_tokens=20 + state_tokens))
    engine.open(prompt_ids(10), SamplingParams(max_tokens=10))  # fits with its state
    with pytest.raises(InputError, match="recurrent state"):
        engine.open(prompt_ids(11), SamplingParams(max_tokens=10))


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny, tmp_path, bits):
    family_checks.assert_quantized(tiny, tmp_path, bits=(bits,))


def test_cli_and_server(tiny):
    family_checks.assert_cli_and_server(tiny)


def test_cli_speculative_decoding(tiny, capsys):
    from mlxcel_cli.main import main

    base = ["generate", "-m", str(tiny), "-p", "hi hi hi hi", "-n", "16", "--no-chat-template", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft-ngram", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == plain["token_ids"] and result["speculative"]["rounds"] > 0


def test_tensor_parallelism_is_refused(tiny):
    from mlxcel_core.distributed.shard import check_shardable

    with pytest.raises(UnsupportedModelError, match="tensor parallelism does not support qwen3_next"):
        check_shardable(load_quiet(tiny).model, 2)


def test_recurrent_draft_model_for_a_transformer_target(tiny, tmp_path):
    """A draft model with recurrent layers goes back to its state at the accepted length after every round: a Llama
    target drafted for by this model gives the Llama's plain tokens."""
    from tiny_models import save_tiny_llama

    from mlxcel_core.engine import SpeculativeConfig

    target = load_quiet(save_tiny_llama(tmp_path / "llama"))
    prompt = prompt_ids(10, seed=7)
    plain = generate(target, [prompt], steps=24, storage="dense")[1][0]
    spec = SpeculativeConfig(num_draft_tokens=4, draft_model=str(tiny))
    engine, tokens = generate(target, [prompt], steps=24, storage="dense", speculative=spec)
    stats = engine.speculator.stats
    assert tokens[0] == plain and stats.proposed > stats.accepted  # rounds rejected draft tokens
