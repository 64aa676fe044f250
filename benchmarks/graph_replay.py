"""A batch-1 decode step replayed as one CUDA graph of our own kernels, outside MLX, checked launch by launch (CUDA
only): the experiment behind backends/cuda/graph_decode.py (on by default on CUDA), kept as its byte-level check.

    python benchmarks/graph_replay.py --model-shape llama-3.2-1b --bits 4 [--tokens 128]

1. An engine with op-by-op decode steps (the Python of each step runs, so `record_launches` sees every launch)
   decodes a few tokens of a random prompt; one more step is recorded, its final RMSNorm as a kernel of ours
   (`rms_norm.final_norm_as_kernel`): each launch's cubin, function, grid and arrays. The inputs made by MLX in the
   step (stale in a replay) and those MLX copies before a launch are listed.
2. The recorded arrays' device addresses are read (one MLX kernel writes them out), the cubins are loaded with the
   driver API, and the launches are captured into one CUDA graph, after a device-to-device copy of the step's output
   token into its input token.
3. Check: every recorded output buffer is zeroed, the graph replayed once with the recorded step's inputs, and each
   output must come back byte for byte. Then MLX runs the next step and the graph replays it (the host writing the
   storage's ints and the RoPE position): each launch's outputs are compared byte for byte.
4. Real decoding: per token the host writes the step's ints and position, launches the graph and reads the token one
   step behind. The tokens are compared with the engine's own (compiled steps, the default), and decode speed is
   reported beside the engine's and mlx-lm's in the same process.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxcel_core.backends.cuda.kernels.cubin_cache import record_launches  # noqa: E402
from mlxcel_core.backends.cuda.kernels.cuda_driver import Driver, addresses, issue_launches  # noqa: E402
from mlxcel_core.backends.cuda.kernels.rms_norm import final_norm_as_kernel  # noqa: E402
from mlxcel_core.backends.cuda.kernels.rope_fold import last_positions  # noqa: E402
from mlxcel_core.bench import RandomIdTokenizer, environment, random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.engine.step_inputs import packed_ints  # noqa: E402
from mlxcel_core.loading.shapes import add_shape_arguments, build_random_model, describe_shape  # noqa: E402
from mlxcel_core.sampling import SamplingParams  # noqa: E402


def write_step_inputs(
    drv: Driver, flat: list[int], position: int, ints_at: int, position_slots: list, host_ints, host_position
) -> None:
    """Queue the copies of a step's ints and RoPE positions (through pinned buffers, which must stay unchanged
    until the copies ran)."""
    (ctypes.c_int32 * len(flat)).from_address(host_ints.value)[:] = flat
    drv.upload(ints_at, host_ints, 4 * len(flat))
    for address, scale in position_slots:  # (device address, RoPE scale)
        ctypes.c_float.from_address(host_position.value).value = np.float32(position) * np.float32(scale)
        drv.upload(address, host_position, 4)


def engine_tokens(engine: Engine, prompt: list[int], count: int, on_decode=None):
    """The engine's greedy tokens for `prompt`, `count` of them, and the seconds from the second token to the last."""
    seq = engine.open(prompt, SamplingParams(max_tokens=count))
    tokens, t1 = [], None
    while engine.has_work() and len(tokens) < count:
        for out in engine.step():
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            if out.token is not None:
                tokens.append(out.token)
                if len(tokens) == 2:
                    t1 = time.perf_counter()
        if on_decode is not None and on_decode():
            return tokens, 0.0, seq
    return tokens, time.perf_counter() - t1, seq


class Recorder:
    """An op-by-op engine whose decode steps can be recorded: wraps its runner's decode and storage's decode_caches."""

    def __init__(self, model, vocab: int):
        # op by op, and no replayed steps of the engine's own: every step is MLX's, through runner.decode
        config = EngineConfig(max_batch_size=1, compile_decode=False, decode_graph=False, storage="paged")
        self.engine = Engine(model, RandomIdTokenizer(vocab), config)
        self.storage = self.engine.storage
        self.storage.pad_block_tables = True  # one block-table width from 512 to 1024 tokens: one recording serves
        self.decodes = 0
        runner, storage = self.engine.runner, self.storage
        decode, caches = runner.decode, storage.decode_caches

        def counted(seq_ids, tokens):
            self.decodes += 1
            self.token_in = tokens
            return decode(seq_ids, tokens)

        def kept(seq_ids):
            views = caches(seq_ids)
            self.step_ints = views[0].slots[0]  # a view at offset 0 of the step's uploaded ints
            self.offset = views[0].offset  # the step's positions: rope_fold.last_positions finds the fold's from it
            return views

        inputs = storage.decode_inputs

        def advanced(seq_ids):
            self.parts = inputs(seq_ids)
            return self.parts

        runner.decode, storage.decode_caches, storage.decode_inputs = counted, kept, advanced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens timed")
    parser.add_argument("--warm", type=int, default=4, help="decode steps before the recorded one")
    parser.add_argument("--no-mlx-lm", action="store_true")
    args = parser.parse_args(argv)
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        print("graph_replay.py needs MLX's CUDA backend", file=sys.stderr)
        return 1
    model, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype, seed=0)
    vocab = config["vocab_size"]
    prompt = random_prompt(vocab, args.prompt_tokens, 0, "graph-replay")
    total = args.warm + args.tokens + 4
    print(f"{describe_shape(args.model_shape, args.bits, args.dtype)}; {environment()}; prompt {args.prompt_tokens}")

    # The engine as generate runs it (compiled steps) and mlx-lm, measured as compare_mlx_lm.py does: the reference
    # tokens and speeds. Twice each: the first run compiles.
    import compare_mlx_lm as compare

    engine = compare.mlxcel_engine(model, vocab, decode_graph=False)  # the reference: MLX's steps, not replays
    for _ in range(2):
        ours = compare.run_mlxcel(engine, prompt, total)
    reference = ours.tokens
    print(f"mlxcel engine: {ours.decode_tps:.1f} tok/s decode, TTFT {ours.ttft_s * 1e3:.0f} ms")
    if not args.no_mlx_lm:
        theirs = compare.build_twin(model, config)
        for _ in range(2):
            run = compare.run_mlx_lm(theirs, prompt, total)
        print(
            f"mlx-lm: {run.decode_tps:.1f} tok/s decode, TTFT {run.ttft_s * 1e3:.0f} ms; greedy tokens agree with "
            f"mlxcel's for {compare.agreeing_prefix(run.tokens, reference)}/{len(reference)}"
        )

    # 1. Record one decode step.
    rec = Recorder(model, vocab)
    tokens, _, seq = engine_tokens(rec.engine, prompt, total, on_decode=lambda: rec.decodes >= args.warm)
    with record_launches() as launches, final_norm_as_kernel():  # the final RMSNorm as a kernel of ours
        rec.engine.step()
    recorded_step = rec.decodes  # this step produced token number `recorded_step` (token 0 is the prefill's)
    bad = [launch for launch in launches if launch.func is None]
    if bad or not launches:
        print(f"cannot replay: {len(bad)} of {len(launches)} launches are not cached kernels")
        return 1
    arrays = {id(a): a for launch in launches for a in launch.inputs + launch.outputs}
    arrays[id(rec.token_in)] = rec.token_in
    arrays[id(rec.step_ints)] = rec.step_ints
    # The RoPE fold's positions are MLX ops on the step's offset (rope_fold.py), not a cached kernel: the replay
    # writes them itself (position * scale, float32, what those ops compute for one row).
    roped = last_positions(rec.offset)
    step_positions = {id(roped[0]): roped} if roped else {}
    arrays.update({k: a for k, (a, _) in step_positions.items()})
    arrays = list(arrays.values())
    mx.eval(arrays)
    mx.synchronize()
    where = dict(zip(map(id, arrays), addresses(arrays)))
    mx.synchronize()
    position_slots = [(where[k], scale) for k, (_, scale) in step_positions.items()]
    ints_at = where[id(rec.step_ints)]
    greedy = next(launch for launch in reversed(launches) if "greedy" in launch.func)
    token_out = where[id(greedy.outputs[0])]
    print(
        f"recorded step {recorded_step}: {len(launches)} launches, {len(arrays)} arrays, "
        f"{len({launch.func for launch in launches})} kernels"
    )
    # Inputs no recorded launch wrote, small enough to be a step's own (weights and pools are not): the step's ints
    # (rewritten per token), the RoPE positions (too), anything else would be stale in a replay.
    base, made = where[id(rec.step_ints)], {id(o) for launch in launches for o in launch.outputs}
    for a in {id(a): a for launch in launches for a in launch.inputs}.values():
        if id(a) not in made and a.size <= 64:
            kind = (
                "step ints"
                if base <= where[id(a)] < base + 4 * 64
                else "rope positions"
                if id(a) in step_positions
                else "OTHER"
            )
            print(f"  step input {a.shape} {a.dtype} at +{where[id(a)] - base}: {kind} {a.tolist()}")

    # Where each launch's inputs come from: an earlier launch's output, the model's weights, the KV pools and combine
    # counters, the step's ints, positions or token. Anything else was made by MLX in the step (a copy, say) and
    # would be stale in a replay.
    from mlx.utils import tree_flatten

    held = [a for _, a in tree_flatten(model.parameters())]
    held += [a for pools in rec.storage.pools if pools for a in pools]
    held += [a for a in rec.storage.combine_counters if a is not None]
    held_at = set(addresses(held))
    spans_out = []
    foreign = 0
    for i, launch in enumerate(launches):
        for j, a in enumerate(launch.inputs):
            at = where[id(a)]
            known = (
                at in held_at
                or id(a) in step_positions
                or at == where[id(rec.token_in)]
                or base <= at < base + 4 * 64
                or any(lo <= at < hi for lo, hi in spans_out)
            )
            if not known:
                foreign += 1
                print(f"  launch {i} {launch.func[:40]} input {j}: {a.shape} {a.dtype} made by MLX in the step")
        spans_out += [(where[id(o)], where[id(o)] + o.nbytes) for o in launch.outputs]
    print(f"inputs made by MLX in the step (stale in a replay): {foreign}")
    launch_inputs = list({id(a): a for launch in launches for a in launch.inputs}.values())
    copied = [
        a for a, at in zip(launch_inputs, addresses(launch_inputs, ensure_row_contiguous=True)) if at != where[id(a)]
    ]
    print(f"inputs MLX copies before a launch (not row-contiguous): {[(a.shape, a.dtype) for a in copied]}")

    # 2. The graph: the previous token in, then every launch.
    drv = Driver()
    token_in = where[id(rec.token_in)]

    def issue():
        drv.copy_on_device(token_in, token_out, 4)
        issue_launches(drv, launches, where)

    graph = drv.capture(issue)

    # 3. Byte-for-byte check of the recorded step. Its token input must hold the token before the recorded one:
    # the graph copies the output token there first, so the output is set to that token before the replay.
    outputs = {id(a): a for launch in launches for a in launch.outputs}
    expected = {k: drv.read(where[k], a.nbytes) for k, a in outputs.items()}
    previous = drv.read(token_in, 4)
    for k, a in outputs.items():
        drv.check(drv.lib.cuMemsetD8Async(where[k], 0, a.nbytes, drv.stream), "cuMemsetD8Async")
    drv.check(drv.lib.cuMemcpyHtoDAsync_v2(token_out, previous, 4, drv.stream), "cuMemcpyHtoDAsync")
    drv.check(drv.lib.cuGraphLaunch(graph, drv.stream), "cuGraphLaunch")
    differ = [k for k, a in outputs.items() if drv.read(where[k], a.nbytes) != expected[k]]
    print(
        f"replayed step: {len(outputs) - len(differ)} of {len(outputs)} outputs byte for byte"
        + (
            f"; differing: {sorted({launch.func for launch in launches for o in launch.outputs if id(o) in differ})}"
            if differ
            else ""
        )
    )

    # 4. The next step by MLX, then by the graph (the storage's ints and the positions written by the host, the
    # token copied on the device): launch by launch, each output must be the same bytes.
    with record_launches() as following, final_norm_as_kernel():
        rec.engine.step()
    recorded_step = rec.decodes
    flat, spans = packed_ints(*rec.parts)
    theirs = list({id(a): a for launch in following for a in launch.outputs}.values())
    mx.eval(theirs)
    mx.synchronize()
    their_at = dict(zip(map(id, theirs), addresses(theirs)))
    mx.synchronize()
    position = flat[spans[3][0]]
    write_step_inputs(drv, flat, position, ints_at, position_slots, drv.pinned(4 * len(flat)), drv.pinned(4))
    drv.check(drv.lib.cuGraphLaunch(graph, drv.stream), "cuGraphLaunch")
    first_bad, bad = None, []
    for i, (mine, other) in enumerate(zip(launches, following)):
        same = all(
            drv.read(where[id(a)], a.nbytes) == drv.read(their_at[id(b)], b.nbytes)
            for a, b in zip(mine.outputs, other.outputs)
        )
        if not same:
            bad.append(i)
            first_bad = first_bad or (i, mine.func)
    print(
        f"step {recorded_step} by MLX ({len(following)} launches) and by the graph: "
        + ("every output the same" if first_bad is None else f"first differing launch {first_bad}")
        + f"; ints {flat[:6]}..., position {position} (MLX's positions {last_positions(rec.offset)[0].tolist()})"
    )
    if bad:
        i = bad[0]
        mine, other = launches[i], following[i]
        print(f"  differing launches: {bad}")
        for a, b in zip(mine.outputs, other.outputs):
            x, y = drv.read(where[id(a)], a.nbytes), drv.read(their_at[id(b)], b.nbytes)
            diff = [k for k in range(len(x)) if x[k] != y[k]]
            print(
                f"  launch {i} output {a.shape} {a.dtype}: {len(diff)} of {len(x)} bytes differ"
                + (f", from byte {diff[0]} to {diff[-1]}" if diff else "")
            )
        mx.eval(other.inputs)
        their_in = addresses(other.inputs)
        for j, (a, at) in enumerate(zip(mine.inputs, their_in)):
            same = drv.read(where[id(a)], a.nbytes) == drv.read(at, a.nbytes)
            print(
                f"  launch {i} input {j} {a.shape} {a.dtype}: {'same' if same else 'DIFFERS'} "
                f"({'same buffer' if where[id(a)] == at else 'other buffers'})"
            )
    their_greedy = next(launch for launch in reversed(following) if "greedy" in launch.func)
    print(
        f"  its token: MLX {their_greedy.outputs[0].tolist()}, graph {list(drv.read(token_out, 4))} (bytes), "
        f"the engine's (compiled) {reference[recorded_step]}"
    )

    # 5. Decode with the graph: the storage's next ints, the graph, the token read one step behind.
    storage = rec.storage
    step_bytes = 4 * len(flat)
    host_ints = [drv.pinned(step_bytes) for _ in range(2)]
    host_token = [drv.pinned(4) for _ in range(2)]
    host_positions = [drv.pinned(4) for _ in range(2)]
    events = [drv.event() for _ in range(2)]
    replayed: list[int] = []
    t1, last = None, 0
    for k in range(args.tokens + 1):
        flat_k, spans_k = packed_ints(*storage.decode_inputs((seq,)))
        if spans_k != spans:
            print(f"step ints changed layout at token {k}: stopping")
            break
        flat = flat_k
        slot, last = k % 2, k
        write_step_inputs(drv, flat, flat[spans[3][0]], ints_at, position_slots, host_ints[slot], host_positions[slot])
        drv.check(drv.lib.cuGraphLaunch(graph, drv.stream), "cuGraphLaunch")
        drv.check(drv.lib.cuMemcpyDtoHAsync_v2(host_token[slot], token_out, 4, drv.stream), "DtoH")
        drv.check(drv.lib.cuEventRecord(events[slot], drv.stream), "cuEventRecord")
        if k:
            drv.check(drv.lib.cuEventSynchronize(events[1 - slot]), "cuEventSynchronize")
            replayed.append(ctypes.c_uint32.from_address(host_token[1 - slot].value).value)
            if k == 1:
                t1 = time.perf_counter()
    drv.check(drv.lib.cuEventSynchronize(events[last % 2]), "cuEventSynchronize")
    replayed.append(ctypes.c_uint32.from_address(host_token[last % 2].value).value)
    seconds = time.perf_counter() - t1
    want = reference[recorded_step + 1 : recorded_step + 1 + len(replayed)]
    agree = compare.agreeing_prefix(replayed, want)
    print(f"first tokens: replay {replayed[:6]}, engine {want[:6]}")
    print(
        f"graph replay: {(len(replayed) - 1) / seconds:.1f} tok/s decode ({len(replayed)} tokens); greedy tokens "
        f"agree with the engine's for {agree}/{len(want)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
