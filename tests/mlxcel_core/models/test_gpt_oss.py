"""gpt-oss: parity with transformers (attention sinks, alternating sliding / full layers, q/k/v/o biases, the biased
top-k router with its softmax over the chosen, interleaved gate/up experts with biases and the clamped SwiGLU,
YaRN), the released checkpoints' older config style and their MXFP4 experts (loaded as MLX mxfp4 banks), what each
feature changes, the engine's paths, quantized copies, the CLI and the server, and the harmony chat template."""

from __future__ import annotations

import json
import shutil

import family_checks
import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from parity import assert_parity, checkpoint_logits, load_quiet, save_tiny_checkpoint
from safetensors.numpy import load_file, save_file
from tiny_configs import GPT_OSS as CONFIG
from tiny_configs import randomize_gpt_oss as randomize
from transformers import GptOssConfig, GptOssForCausalLM

from mlxcel_core.errors import CorruptModelError, UnsupportedModelError
from mlxcel_core.models import gpt_oss
from mlxcel_core.models.moe import QuantizedSwitchLinear

SLIDING, FULL = "sliding_attention", "full_attention"
# The reference is transformers >= 5.24: 5.17 (the H200 image's) computes other gpt-oss logits (2.2 apart here).
REFERENCE = pytest.mark.skipif(
    tuple(map(int, transformers.__version__.split(".")[:2])) < (5, 24),
    reason="gpt-oss parity needs transformers >= 5.24",
)
# What the released checkpoints' config.json names besides GptOssConfig's keys.
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss"), GptOssConfig, GptOssForCausalLM, **CONFIG)
    return randomize(path)


def edit_config(src, dst, edit):
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def edit_weights(src, dst, edit):
    path = shutil.copytree(src, dst)
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def older_style(config: dict) -> None:
    """config.json as the released checkpoints have it (transformers 4.55): rope_theta + rope_scaling, the older
    keys transformers ignores (experts_per_token, initial_context_length); layer_types left to the default."""
    rope = config.pop("rope_parameters")
    assert config.pop("layer_types") == [SLIDING, FULL, SLIDING, FULL]
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, experts_per_token=3, initial_context_length=64)


@REFERENCE
def test_parity_with_transformers(tiny_gpt_oss):
    assert_parity(tiny_gpt_oss)


@REFERENCE
def test_parity_older_config_style(tiny_gpt_oss, tmp_path):
    assert_parity(edit_config(tiny_gpt_oss, tmp_path / "old", older_style))


def test_architecture_follows_config(tiny_gpt_oss):
    model = load_quiet(tiny_gpt_oss).model
    assert [layer.self_attn.window for layer in model.layers] == [8, None, 8, None]
    attn = model.layers[0].self_attn
    assert attn.sinks.shape == (4,) and all("bias" in attn[p] for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp = model.layers[0].mlp
    assert mlp.top_k == 2 and mlp.router.bias.shape == (4,)
    assert mlp.experts.gate_proj.weight.shape == (4, 64, 64) and mlp.experts.down_proj.bias.shape == (4, 64)
    assert attn.rope.mscale == pytest.approx(0.1 * np.log(8.0) + 1.0)


def test_rope_defaults_follow_gpt_oss_config():
    """No rope_parameters / rope_scaling: GptOssConfig's YaRN (factor 32 over 4096, truncate off) with rope_theta, or
    150000; the inverse frequencies and the attention factor are transformers' own."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    for extra in ({}, {"rope_theta": 50000.0}):
        small = dict(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2, **extra)
        theirs = GptOssRotaryEmbedding(GptOssConfig(**small))
        args = gpt_oss.ModelArgs.from_dict({"model_type": "gpt_oss", **small})
        rope = gpt_oss.Model(args).layers[0].self_attn.rope
        np.testing.assert_allclose(1.0 / np.array(rope._periods), theirs.inv_freq.numpy(), rtol=1e-6)
        assert rope.mscale == pytest.approx(theirs.attention_scaling)


def test_sinks_matter(tiny_gpt_oss, tmp_path):
    """The fixture's sinks reach the logits: zeroed, the logits differ (a zero logit still joins each softmax)."""
    reference = checkpoint_logits(tiny_gpt_oss)
    zeroed = edit_weights(
        tiny_gpt_oss, tmp_path / "zero-sinks", lambda w: w.update({k: 0 * v for k, v in w.items() if "sinks" in k})
    )
    assert np.abs(checkpoint_logits(zeroed) - reference).max() > 1e-2


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 4096},  # the window
        {"layer_types": [FULL, SLIDING, SLIDING, FULL]},  # which layers slide
        {"swiglu_limit": 7.0},  # the clamps
        {"swiglu_alpha": 1.3},
        {"num_experts_per_tok": 3},  # the router's top-k
    ],
    ids=["window", "layer-types", "limit", "alpha", "top-k"],
)
def test_config_keys_matter(tiny_gpt_oss, tmp_path, change):
    reference = checkpoint_logits(tiny_gpt_oss)
    path = edit_config(tiny_gpt_oss, tmp_path / "changed", lambda c: c.update(change))
    assert np.abs(checkpoint_logits(path) - reference).max() > 1e-3


def test_clamped_swiglu_is_transformers():
    """GptOssExperts._apply_gate, at the alpha and limit transformers took from the config (5.24 reads swiglu_alpha)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(swiglu_limit=0.5, swiglu_alpha=1.3))
    gate_up = torch.randn(3, 5, 16) * 2
    want = experts._apply_gate(gate_up).numpy()
    act = gpt_oss.clamped_swiglu(experts.alpha, experts.limit)
    got = act(mx.array(gate_up[..., ::2].numpy()), mx.array(gate_up[..., 1::2].numpy()))
    np.testing.assert_allclose(np.array(got), want, atol=1e-6, rtol=1e-6)  # (float32 rounding on the GPU)


# -- MXFP4 experts (the released checkpoints) ----------------------------------------------------------------------


def to_mxfp4(weights: dict, seed: int = 1) -> None:
    """Replace each expert projection by random MXFP4 blocks and scales of its shape (what the released checkpoints
    store: out x in, groups of 32 along in); scales near 2^-3 keep the activations in range."""
    rng = np.random.default_rng(seed)
    for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, dim_in, dim_out = weights.pop(name).shape  # transformers' [E, in, out]
        weights[f"{name}_blocks"] = rng.integers(0, 256, size=(experts, dim_out, dim_in // 32, 16), dtype=np.uint8)
        weights[f"{name}_scales"] = rng.integers(122, 126, size=(experts, dim_out, dim_in // 32), dtype=np.uint8)


@pytest.fixture(scope="module")
def tiny_mxfp4(tiny_gpt_oss, tmp_path_factory):
    path = edit_weights(tiny_gpt_oss, tmp_path_factory.mktemp("mxfp4") / "m", to_mxfp4)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    return path


def test_mxfp4_experts_load_as_mlx_mxfp4_banks(tiny_mxfp4):
    """The blocks and scales become MLX mxfp4 banks as they are: mx.dequantize of the loaded gate, up and down banks
    equals transformers' own dequantization (convert_moe_packed_tensors) of the same bytes, value for value."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = load_quiet(tiny_mxfp4).model
    raw = load_file(tiny_mxfp4 / "model.safetensors")
    experts = model.layers[2].mlp.experts
    theirs = {}
    for name in ("gate_up_proj", "down_proj"):
        prefix = f"model.layers.2.mlp.experts.{name}"
        blocks, scales = (torch.from_numpy(raw[f"{prefix}_{part}"]) for part in ("blocks", "scales"))
        theirs[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()  # [E, in, out]
    want = {
        "gate_proj": theirs["gate_up_proj"][..., 0::2],
        "up_proj": theirs["gate_up_proj"][..., 1::2],
        "down_proj": theirs["down_proj"],
    }
    for name, expected in want.items():
        bank = experts[name]
        assert isinstance(bank, QuantizedSwitchLinear) and (bank.mode, bank.group_size, bank.bits) == ("mxfp4", 32, 4)
        ours = mx.dequantize(bank.weight, bank.scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
        np.testing.assert_array_equal(np.array(ours), expected.transpose(0, 2, 1), err_msg=name)


@REFERENCE
def test_mxfp4_parity_with_transformers(tiny_mxfp4):
    """transformers (no Triton here) dequantizes the blocks to fp32 and runs its experts on them; our mxfp4 kernels
    give its logits and greedy tokens."""
    assert_parity(tiny_mxfp4)


def test_mxfp4_keeps_the_rest_unquantized(tiny_mxfp4):
    import mlx.nn as nn

    model = load_quiet(tiny_mxfp4).model
    layer = model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.Linear and type(layer.mlp.router) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear


def test_modules_to_not_convert_decides_which_experts_are_mxfp4():
    args = gpt_oss.ModelArgs.from_dict(
        {"num_hidden_layers": 12, "quantization_config": {**MXFP4_CONFIG, "modules_to_not_convert": ["model.layers.1"]}}
    )
    assert [args.experts_in_mxfp4(i) for i in (0, 1, 10, 11)] == [True, False, True, True]
    args = gpt_oss.ModelArgs.from_dict({"quantization_config": {**MXFP4_CONFIG, "modules_to_not_convert": ["experts"]}})
    assert not args.experts_in_mxfp4(0)
    assert not gpt_oss.ModelArgs.from_dict({}).experts_in_mxfp4(0)


def test_mxfp4_blocks_the_config_does_not_announce_are_refused(tiny_mxfp4, tmp_path):
    for name, edit in {
        "no-quantization-config": lambda c: c.pop("quantization_config"),
        "experts-not-converted": lambda c: c["quantization_config"]["modules_to_not_convert"].append("mlp.experts"),
    }.items():
        with pytest.raises(CorruptModelError, match="MXFP4 blocks"):
            load_quiet(edit_config(tiny_mxfp4, tmp_path / name, edit))


# -- the engine, quantized copies, CLI and server ------------------------------------------------------------------


def test_engine_paths(tiny_gpt_oss):
    family_checks.assert_engine_paths(tiny_gpt_oss)


@pytest.mark.parametrize("bits", family_checks.BITS)
def test_quantized(tiny_gpt_oss, tmp_path, bits):
    family_checks.assert_quantized(tiny_gpt_oss, tmp_path, bits=(bits,))


@REFERENCE
def test_cli_and_server(tiny_gpt_oss):
    family_checks.assert_cli_and_server(tiny_gpt_oss)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
        ({"layer_types": [SLIDING, "chunked_attention", SLIDING, FULL]}, "chunked_attention"),
    ],
    ids=["quant-method", "layer-type"],
)
def test_refuses_what_it_does_not_implement(tiny_gpt_oss, tmp_path, change, message):
    path = edit_config(tiny_gpt_oss, tmp_path / "refused", lambda c: c.update(change))
    with pytest.raises(UnsupportedModelError, match=message):
        load_quiet(path)


# -- the harmony chat template -------------------------------------------------------------------------------------

# The constructs gpt-oss's harmony template uses: a macro with a default argument, `is not defined` defaults set
# inside it, strftime_now, a namespace mutated in a loop, messages[1:], `in` tests on message keys, channels,
# `thinking`, tool calls with tojson, loop.last, raise_exception, whitespace control.
HARMONY = """{#- harmony-style test template -#}
{%- macro system_message(effort_default="medium") -%}
    {%- if model_identity is not defined %}{%- set model_identity = "You are a test model." %}{%- endif %}
    {{- model_identity + "\\nCurrent date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
    {%- if reasoning_effort is not defined %}{%- set reasoning_effort = effort_default %}{%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n# Valid channels: analysis, commentary, final." }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" + system_message() + "<|end|>" }}
{%- if messages[0].role in ("system", "developer") %}
    {%- set developer = messages[0].content %}{%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer = "" %}{%- set loop_messages = messages %}
{%- endif %}
{%- if developer %}{{- "<|start|>developer<|message|># Instructions\\n\\n" + developer + "<|end|>" }}{%- endif %}
{%- set last_tool = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == "assistant" -%}
        {%- if "content" in message and "<|channel|>" in message.content %}
            {{- raise_exception("pass the analysis in 'thinking', not in content") }}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {%- set call = message.tool_calls[0].function %}
            {%- if message.thinking %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
            {{- call.arguments|tojson + "<|call|>" }}
            {%- set last_tool.name = call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "tool" -%}
        {%- if last_tool.name is none %}{{- raise_exception("a tool message needs an earlier tool call") }}{%- endif %}
        {{- "<|start|>functions." + last_tool.name + " to=assistant<|channel|>commentary<|message|>" }}
        {{- message.content|tojson + "<|end|>" }}
    {%- else -%}
        {{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi"}],
    "developer": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "tool-call": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,  # as OpenAI clients send it: dropped, as transformers drops it
            "reasoning_content": "Call the tool.",  # read as `thinking`
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris ü"}}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "thinking": "It said sunny."},
        {"role": "user", "content": "Thanks"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("variables", [{}, {"reasoning_effort": "high", "model_identity": "Test."}], ids=["", "vars"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_harmony_template_renders_as_transformers(name, variables, add_generation_prompt):
    from transformers.utils import chat_template_utils

    if not hasattr(chat_template_utils, "_normalize_chat_messages"):
        pytest.skip("transformers before 5.24 hands templates other messages (no None dropping, no reasoning alias)")
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    from mlxcel_core.chat_template import render_chat

    messages = CONVERSATIONS[name]
    (want,), _ = render_jinja_template(
        [_normalize_chat_messages(messages)],
        chat_template=HARMONY,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    got = render_chat(HARMONY, messages, add_generation_prompt, **variables)
    assert got == want
    assert "Current date: 20" in got and ("Reasoning: high" in got) == bool(variables)


def test_harmony_template_raises_its_errors():
    from mlxcel_core.chat_template import render_chat
    from mlxcel_core.errors import InputError

    with pytest.raises(InputError, match="thinking"):
        render_chat(HARMONY, [{"role": "assistant", "content": "<|channel|>analysis<|message|>x"}])
    with pytest.raises(InputError, match="earlier tool call"):
        render_chat(HARMONY, [{"role": "tool", "content": "x"}])


def test_generation_blocks_render_their_body():
    """transformers' `{% generation %}` tag (templates mark the assistant's tokens with it) renders its body."""
    from mlxcel_core.chat_template import render_chat

    template = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "[a][b]"


def test_bench_shape_builds_with_mxfp4_experts(monkeypatch):
    """`mlxcel bench --model-shape gpt-oss-20b`, scaled down: experts in MLX's mxfp4 mode as released (with or without
    --bits, which quantizes the rest), a forward runs, and the parameters count as the values they encode."""
    import mlx.nn as nn

    from mlxcel_core.loading import shapes

    small = dict(shapes.SHAPES["gpt-oss-20b"], hidden_size=128, num_hidden_layers=2, num_local_experts=4)
    small.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=64, vocab_size=256)
    monkeypatch.setitem(shapes.SHAPES, "gpt-oss-small", small)
    monkeypatch.setitem(shapes.SHAPES, "gpt-oss-small-float", dict(small, quantization_config=None))
    unquantized, _ = shapes.count_parameters(shapes.build_random_model("gpt-oss-small-float", dtype="float32")[0])
    for bits in (None, 4):
        model, _ = shapes.build_random_model("gpt-oss-small", bits=bits, dtype="float32")
        bank = model.layers[1].mlp.experts.down_proj
        assert isinstance(bank, QuantizedSwitchLinear) and (bank.mode, bank.group_size, bank.bits) == ("mxfp4", 32, 4)
        assert isinstance(model.layers[1].self_attn.q_proj, nn.QuantizedLinear) == (bits == 4)
        assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 256)
        assert shapes.count_parameters(model)[0] == unquantized
    assert shapes.describe_shape("gpt-oss-20b", 4, "bfloat16") == "gpt-oss-20b (random) Q4 g64, experts mxfp4"
