"""Tensor parallelism (issue 10): `--tp-size 2` over the ring backend on 127.0.0.1, 2 processes on this host.

Greedy output must equal the single-process run token for token (Llama, Qwen3, Granite, Ministral 3, Mixtral);
heads that do not divide are refused in one line; a rank that dies or never joins makes the other exit non-zero quickly.
Every subprocess runs under a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from parity import save_tiny_checkpoint
from ranks import two_ranks_here
from tiny_models import FakeGroup, save_tiny_llama
from tp_checks import GEN, TIMEOUT, TINY, assert_tp_matches, mlxcel


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tp-llama"))


@two_ranks_here
def test_llama_tp2_greedy_equals_single_process(llama):
    assert_tp_matches(llama)


@two_ranks_here
def test_qwen3_tp2_greedy_equals_single_process(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = save_tiny_checkpoint(
        tmp_path,
        Qwen3Config,
        Qwen3ForCausalLM,
        **TINY,
        head_dim=32,
        tie_word_embeddings=True,
    )
    assert_tp_matches(path)


@two_ranks_here
def test_granite_tp2_greedy_equals_single_process(tmp_path):
    """Granite's residual multiplier scales each block's output after the row-parallel sum; its o_proj and
    down_proj biases are added once, after it; the embedding multiplier and logits scaling stay whole."""
    from transformers import GraniteConfig, GraniteForCausalLM

    path = save_tiny_checkpoint(
        tmp_path,
        GraniteConfig,
        GraniteForCausalLM,
        **TINY,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        embedding_multiplier=3.0,
        attention_multiplier=0.3,
        residual_multiplier=0.22,
        logits_scaling=2.5,
    )
    assert_tp_matches(path)


@two_ranks_here
def test_ministral3_tp2_greedy_equals_single_process(tmp_path):
    """Ministral 3's position-dependent query scale (from position 16 on here, so the prompt and the steps cross
    it), YaRN and a sliding window, sharded by heads."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    path = save_tiny_checkpoint(
        tmp_path,
        Ministral3Config,
        Ministral3ForCausalLM,
        **TINY,
        head_dim=32,
        sliding_window=24,
        rope_parameters={**rope, "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.5},
    )
    assert_tp_matches(path)


@two_ranks_here
def test_mixtral_tp2_experts_sharded_greedy_equals_single_process(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    path = save_tiny_checkpoint(
        tmp_path,
        MixtralConfig,
        MixtralForCausalLM,
        **TINY,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    assert_tp_matches(path)


@two_ranks_here
def test_prompt_from_stdin_reaches_every_rank(llama):
    args = ["generate", "-m", str(llama), *GEN]
    single = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", *args],
        input="Hello world",
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    parallel = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", *args, "--tp-size", "2"],
        input="Hello world",
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert parallel.returncode == 0, parallel.stderr
    assert json.loads(parallel.stdout)["token_ids"] == json.loads(single.stdout)["token_ids"]


@two_ranks_here
def test_only_rank0_prints(llama):
    result = mlxcel("generate", "-m", str(llama), "-p", "Hello", "-n", "4", "--tp-size", "2")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("mlxcel: model:") == 1 and result.stderr.count("generation:") == 1
    assert "tensor parallel: 2 ranks" in result.stderr


@two_ranks_here
def test_heads_that_do_not_divide_are_refused(tmp_path):
    # SmolLM2's geometry in small: 3 query heads, 3 KV heads cannot be split over 2 ranks.
    path = save_tiny_llama(tmp_path, hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    result = mlxcel("generate", "-m", str(path), "-p", "Hello", "-n", "4", "--tp-size", "2")
    assert result.returncode == 2
    assert "--tp-size 2 must divide the attention heads evenly" in result.stderr
    assert "3 query heads and 3 KV heads" in result.stderr
    assert result.stderr.count("must divide") == 1  # rank 0 says it; rank 1, which raised the same, does not
    assert "Traceback" not in result.stderr


def test_bad_tp_size_is_a_usage_error(llama):
    result = mlxcel("generate", "-m", str(llama), "-p", "Hello", "--tp-size", "0")
    assert result.returncode == 2 and "--tp-size must be >= 1" in result.stderr


def test_each_rank_holds_only_its_slices(llama):
    """In process (no collective runs): rank 1 of 2 keeps its half of q/k/v/gate/up rows, o/down columns."""
    import mlx.core as mx

    from mlxcel_core.distributed.shard import RowParallelLinear
    from mlxcel_core.loading import load_model

    full = load_model(str(llama), log=lambda m: None).model
    part = load_model(str(llama), log=lambda m: None, group=FakeGroup(1, 2)).model
    fa, pa = full.layers[0].self_attn, part.layers[0].self_attn
    assert (pa.n_heads, pa.n_kv_heads) == (2, 1)
    assert mx.array_equal(pa.q_proj.weight, fa.q_proj.weight[32:])
    assert mx.array_equal(pa.k_proj.weight, fa.k_proj.weight[16:])
    assert mx.array_equal(pa.o_proj.weight, fa.o_proj.weight[:, 32:])
    assert isinstance(pa.o_proj, RowParallelLinear)
    fm, pm = full.layers[0].mlp, part.layers[0].mlp
    assert mx.array_equal(pm.up_proj.weight, fm.up_proj.weight[64:])
    assert mx.array_equal(pm.down_proj.weight, fm.down_proj.weight[:, 64:])
    assert isinstance(pm.down_proj, RowParallelLinear)
    assert mx.array_equal(part.lm_head.weight, full.lm_head.weight)  # replicated


def _rank_env(rank, hostfile, **extra):
    return {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile, **extra}


def _hostfile(tmp_path, n=2):
    from mlxcel_core.distributed.group import _free_ports

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    return str(path)


def test_rank_that_dies_makes_the_other_fail_quickly(llama, tmp_path):
    hostfile = _hostfile(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "mlxcel_cli.main",
        "generate",
        "-m",
        str(llama),
        "-p",
        "Hello",
        "-n",
        "400",
        "--tp-size",
        "2",
        "--no-chat-template",
    ]
    rank0 = subprocess.Popen(
        cmd,
        env=_rank_env(0, hostfile),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    rank1 = subprocess.Popen(
        cmd, env=_rank_env(1, hostfile), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(rank0.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not any("tensor parallel" in line for line in lines):  # both joined, rank 0 is about to decode
            assert time.monotonic() < deadline and rank0.poll() is None, "".join(lines)
            time.sleep(0.01)
        rank1.send_signal(signal.SIGKILL)
        start = time.monotonic()
        code = rank0.wait(timeout=60)
        elapsed = time.monotonic() - start
        reader.join(timeout=5)
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait()
    err = "".join(lines)
    assert code == 1, err
    assert elapsed < 60
    assert "rank 0: lost the connection to another rank" in err and "Traceback" not in err


def test_rank_that_never_joins_makes_the_other_fail_within_the_timeout(llama, tmp_path):
    hostfile = _hostfile(tmp_path)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "generate", "-m", str(llama), "-p", "Hello", "--tp-size", "2"],
        env=_rank_env(0, hostfile, MLXCEL_TP_JOIN_TIMEOUT="3"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0  # killed by the join watchdog (SIGKILL: the connect loop holds the GIL)
    assert time.monotonic() - start < 30
    assert "the other ranks did not join within 3 s" in result.stderr


def test_launch_count_must_match_tp_size(llama, tmp_path):
    hostfile = _hostfile(tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mlxcel_cli.main", "generate", "-m", str(llama), "-p", "Hi", "--tp-size", "3"],
            env=_rank_env(r, hostfile),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 2
    assert "--tp-size 3 but 2 ranks were launched" in outs[0][1]


@pytest.mark.real_model
def test_smollm2_gguf_heads_do_not_divide_by_2(smollm2_gguf):
    result = mlxcel("generate", "-m", str(smollm2_gguf), "-p", "Hello", "-n", "4", "--tp-size", "2")
    assert result.returncode == 2
    assert "9 query heads and 3 KV heads" in result.stderr


@pytest.mark.real_model
def test_smollm2_gguf_tp3_greedy_equals_single_process(smollm2_gguf):
    """9 query / 3 KV heads split over 3 ranks (3 processes on this host), Q4_1 groups of 32 per rank."""
    prompt = "What is the capital of France?"
    single = mlxcel("generate", "-m", str(smollm2_gguf), "-p", prompt, "-n", "24", "--json")
    parallel = mlxcel("generate", "-m", str(smollm2_gguf), "-p", prompt, "-n", "24", "--json", "--tp-size", "3")
    assert single.returncode == 0 and parallel.returncode == 0, parallel.stderr
    assert json.loads(parallel.stdout)["token_ids"] == json.loads(single.stdout)["token_ids"]


@two_ranks_here
def test_bench_tp2_reports_rows_from_rank0_only(llama):
    result = mlxcel(
        "bench", "-m", str(llama), "-p", "16", "-n", "8", "-r", "1", "--no-warmup", "-o", "jsonl", "--tp-size", "2"
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(rows) == 2  # pp16 and tg8, printed once
    assert "tensor parallel over 2 ranks" in result.stderr
