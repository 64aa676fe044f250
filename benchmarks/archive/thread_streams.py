"""Which arrays a second thread may hand to `mx.async_eval` on MLX's CUDA backend (MLX 0.32 streams belong to the
thread that made them). One case per process: python benchmarks/thread_streams.py CASE; prints "CASE ok" or the
error. Cases: the graph is built on the main thread inside `mx.stream(s)` of a `new_thread_unsafe_stream` s, from
an input x that is
  evaluated      made on the main thread's default stream and evaluated there (mx.eval)
  lazy           made on the main thread's default stream, not evaluated
  async          made on the default stream and async_eval'ed there (maybe still running)
  on_s           made inside mx.stream(s) and evaluated
and the worker launches it bare, or inside mx.stream(s) (suffix _ctx). And whether an mx.compile trace keeps the
stream it was traced on: a compiled function (shapeless, or traced for the same shape) first called on the main
thread's default stream, then inside mx.stream(s):
  compiled_shapeless, compiled_shaped, compiled_fresh (first called inside mx.stream(s): the control)"""

import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx


def main(case: str) -> None:
    s = mx.new_thread_unsafe_stream(mx.default_device())
    kind, ctx = case.removesuffix("_ctx"), case.endswith("_ctx")
    if kind.startswith("compiled"):
        f = mx.compile(lambda a: a * 2 + 1, shapeless=kind == "compiled_shapeless")
        x = mx.ones((256, 256))
        mx.eval(x)
        if kind != "compiled_fresh":
            mx.eval(f(x))  # traced on the main thread's default stream
        with mx.stream(s):
            y = (f(x) @ x).sum()
    elif kind == "on_s":
        with mx.stream(s):
            x = mx.ones((256, 256))
            mx.eval(x)
    else:
        x = mx.ones((256, 256))
        if kind == "evaluated":
            mx.eval(x)
        elif kind == "async":
            x = x @ x
            mx.async_eval(x)
    if not kind.startswith("compiled"):
        with mx.stream(s):
            y = (x @ x).sum()

    def launch():
        if ctx:
            with mx.stream(s):
                mx.async_eval(y)
        else:
            mx.async_eval(y)

    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(launch).result()
        with mx.stream(s):
            print(case, "ok", y.item())
    except Exception as e:  # noqa: BLE001 (the probe reports whatever MLX raises)
        print(case, "error:", e)


if __name__ == "__main__":
    main(sys.argv[1])
