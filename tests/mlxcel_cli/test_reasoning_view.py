"""`--reasoning show|hide` on `mlxcel generate` and `mlxcel run` (mlxcel_cli/reasoning_view.py), and a chat's history
keeping a reasoning model's answer apart from its reasoning (mlxcel_core/chat.py).

The tiny random Llama with a DeepSeek-R1-style template that opens `<think>` in the prompt: its whole (random) reply
is then reasoning, never closed, so `show` prints it between `<think>` and `</think>` lines and `hide` prints
nothing; the reasoning equals the generated token ids decoded (and stripped)."""

from __future__ import annotations

import json
import shutil

import pytest

from mlxcel_cli.main import main

OPENS_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}{# closes with </think> #}"
)


@pytest.fixture(scope="module")
def thinker(tiny_llama_dir, tmp_path_factory):
    path = shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("thinker") / "model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OPENS_THINK}))
    return path


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([*args])
    out, err = capsys.readouterr()
    return code, out, err


def decoded(model, ids: list[int]) -> str:
    from mlxcel_core.loading.hf import read_config
    from mlxcel_core.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(model, read_config(model)).decode(ids)


def test_generate_json_and_show_hide(capsys, thinker):
    args = ["generate", "-m", str(thinker), "-p", "Hi", "-n", "12"]
    code, out, _ = cli(capsys, *args, "--json")
    assert code == 0
    result = json.loads(out)
    reasoning = decoded(thinker, result["token_ids"]).strip()
    assert reasoning and result["reasoning"] == reasoning and result["text"] == ""
    assert cli(capsys, *args)[1] == f"<think>\n{reasoning}\n</think>\n\n\n"
    assert cli(capsys, *args, "--reasoning", "hide")[1] == "\n"
    hidden = json.loads(cli(capsys, *args, "--reasoning", "hide", "--json")[1])
    assert "reasoning" not in hidden and hidden["text"] == ""
    assert cli(capsys, "run", str(thinker), "-p", "Hi", "-n", "12", "--reasoning", "hide")[1] == "\n"


def test_a_constraint_or_no_template_is_not_split(capsys, thinker):
    code, out, _ = cli(capsys, "generate", "-m", str(thinker), "-p", "Hi", "-n", "6", "--no-chat-template", "--json")
    assert code == 0 and "reasoning" not in json.loads(out)
    code, out, _ = cli(capsys, "generate", "-m", str(thinker), "-p", "Hi", "--regex", "[ab]{3}", "--json")
    result = json.loads(out)
    assert code == 0 and "reasoning" not in result and len(result["text"]) == 3


def test_a_bad_mode_is_exit_2(capsys, thinker):
    code, _, err = cli(capsys, "generate", "-m", str(thinker), "-p", "Hi", "--reasoning", "maybe")
    assert code == 2 and err.strip() == "mlxcel: error: --reasoning must be show or hide, got 'maybe'"


def test_chat_keeps_the_answer_and_the_reasoning_apart(thinker):
    from mlxcel_core.chat import ChatSession
    from mlxcel_core.loading import load_model
    from mlxcel_core.sampling import SamplingParams

    chat = ChatSession(load_model(str(thinker)), SamplingParams(max_tokens=8))
    text = chat.ask("Hi")
    reply = chat.messages[-1]
    assert reply["content"] == "" and reply["reasoning_content"] == text.strip() != ""
