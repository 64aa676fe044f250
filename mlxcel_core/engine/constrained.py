"""Constrained decoding in the engine: each constrained row's grammar matcher and its allowed-token masks.

The life of a constrained row (engine.py drives it; the Constraint spec and its grammar are
mlxcel_core/constraints.py):

- `Engine.open` makes the row's `RowConstraint`: an llguidance matcher for the constraint's grammar over the
  model's tokenizer. The grammar is checked (a never-seen one) and the matcher compiled on a worker thread, beside
  the prompt's prefill (the host mostly waits on the device there, outside the GIL); the row's first mask waits for
  it. A bad grammar ends the row with "error" there; one known to be bad is refused by `Engine.open` itself. The
  tokenizer's llguidance form (~1-2 s to build) is built once per tokenizer, ahead of time where the caller knows it
  will be needed (`prepare`); a constraint seen before is a copy of a cached matcher.
- Every step that samples the row: after the step's forward is submitted, the host computes the batch's bitmask of
  allowed tokens (`next_masks`: every constrained row's, in one array) while the device computes the
  logits; the packed bitmask goes to the device as it is and sets every other token's logit to -inf before the
  sampler's first stage (`apply_bitmask`, one compiled kernel on a GPU), so a disallowed token is never drawn,
  greedy or sampled. No allowed token, or a matcher in error, is a dead end: that row ends with "error".
- Every committed token advances the matcher (`advance`); once the grammar is complete (`stopped`) the row ends
  with "stop". EOS is allowed whenever the grammar accepts.
- A speculative round verifies drafts against the masks: `draft_masks` gives each position the mask after the
  draft tokens before it, and rolls the matcher back after.
- The row ends: the matcher is dropped with the Sequence.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from .. import backends
from ..constraints import Constraint, ConstraintError, compiled_now, grammar_of
from ..sampling import apply_allowed

MATCHER_CACHE_SIZE = 32  # compiled grammars kept per tokenizer (a deep copy costs ~10 us, a compile ms)

_lock = threading.Lock()
_tokenizers: dict[tuple[int, int], tuple[object, Future]] = {}  # (id(backend), n_vocab) -> (backend, LLTokenizer)
_builder: ThreadPoolExecutor | None = None
_masker = None  # apply_bitmask's function: compiled or not, as the backend compiles its steps


class ConstraintDeadEnd(RuntimeError):
    """The grammar allows no next token (or its matcher failed): the row cannot go on."""


def vocab_words(n_vocab: int) -> int:
    """32-bit words of one row's bitmask."""
    return (n_vocab + 31) // 32


def prepare(tokenizer, n_vocab: int) -> Future:
    """Start building the tokenizer's llguidance form (once per tokenizer and vocabulary size) on a worker thread.

    A server calls this when its model loads, so the first constrained request does not wait ~1-2 s for it."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:  # e.g. the benchmarks' RandomIdTokenizer: no text, so no grammar
        failed = Future()
        failed.set_exception(ValueError(f"{type(tokenizer).__name__} has no `tokenizers` tokenizer"))
        return failed
    n_vocab = max(n_vocab, tokenizer.vocab_size)  # llguidance refuses fewer ids than the tokenizer has
    key = (id(backend), n_vocab)
    with _lock:
        known = _tokenizers.get(key)
        if known is not None and known[0] is backend:
            return known[1]
        eos = sorted(tokenizer.eos_token_ids) or None
        future = _pool().submit(_build_tokenizer, backend, n_vocab, eos)
        _tokenizers[key] = (backend, future)
        return future


def _pool() -> ThreadPoolExecutor:
    """The worker threads that build tokenizers and compile grammars. llguidance holds the GIL while it compiles: they
    run while the engine's thread waits on the device or in MLX (which releases it). Two: a matcher's compile waits
    for its tokenizer's build, which must not queue behind it."""
    global _builder
    if _builder is None:
        _builder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mlxcel-grammar")
    return _builder


def _build_tokenizer(backend, n_vocab: int, eos: list[int] | None):
    """llguidance reads the `tokenizers` tokenizer from its JSON form (what llguidance.hf does for transformers').

    llguidance takes every added token of that form for a special token, also those the tokenizer holds as text
    ("special": false, e.g. Qwen's `<tool_call>`): a grammar's text "<tool_call>" would then force that token and
    refuse it when it comes. Where the tokenizer has such tokens, the vocabulary goes to llguidance again as bytes
    with only the truly special tokens marked, and the tokenizer's own encoding."""
    import llguidance

    form = backend.to_str()
    base = _ll_tokenizer(form, n_vocab, eos)
    as_text = {a["id"] for a in json.loads(form).get("added_tokens", []) if not a.get("special")}
    if not as_text:
        return base
    vocab = _Vocabulary(backend, base, as_text, eos)
    return _ll_tokenizer(llguidance.TokenizerWrapper(vocab), n_vocab, eos)


def _ll_tokenizer(form, n_vocab: int, eos: list[int] | None):
    """llguidance 1.7+ takes every EOS id; 1.6, the newest built for glibc 2.28 (RHEL 8 and many GPU hosts), takes
    one: there the first, and the grammar's end allows that one alone."""
    import llguidance

    try:
        return llguidance.LLTokenizer(form, n_vocab=n_vocab, eos_token=eos)
    except TypeError:
        if not eos:
            raise
        return llguidance.LLTokenizer(form, n_vocab=n_vocab, eos_token=eos[0])


class _Vocabulary:
    """A vocabulary in the form `llguidance.TokenizerWrapper` reads: each id's bytes (llguidance's own reading of the
    JSON form), the special ids less those held as text, and text to ids by the tokenizer itself."""

    def __init__(self, backend, base, as_text: set[int], eos: list[int] | None):
        n = base.vocab_size
        self.tokens = [base.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if i not in as_text and base.is_special_token(i)]
        self.eos_token_id, self.bos_token_id = (eos[0] if eos else base.eos_token), None
        self._backend = backend

    def __call__(self, text):
        if isinstance(text, bytes):  # (TokenizerWrapper then hands over str)
            raise TypeError("text, not bytes")
        return self._backend.encode(text, add_special_tokens=False).ids


class Grammars:
    """One engine's source of matchers: its tokenizer in llguidance's form and recently compiled grammars."""

    def __init__(self, tokenizer, n_vocab: int):
        """`n_vocab`: the model's logits width (masks cover it and the tokenizer's ids, whichever is more)."""
        self.tokenizer, self.n_vocab = tokenizer, n_vocab
        self.mask_vocab = max(n_vocab, tokenizer.vocab_size)
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()  # its compiled matcher, copied per row

    def open(self, constraint: Constraint) -> "RowConstraint":
        """The row's grammar state, its matcher compiling on a worker thread. A constraint known to be bad raises
        ConstraintError here; one never seen is checked on that thread, beside the prefill (a bad one ends the row
        with "error" naming the problem, where its first mask is due)."""
        if compiled_now(constraint):
            grammar_of(constraint)
        template = self._cache.get(constraint)
        if template is None:
            tokenizer = prepare(self.tokenizer, self.n_vocab)
            template = self._cache[constraint] = _pool().submit(_compile, tokenizer, constraint)
            if len(self._cache) > MATCHER_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(constraint)
        return RowConstraint(constraint, template, self.mask_vocab)


def _compile(tokenizer: Future, constraint: Constraint):
    """A fresh matcher for the constraint's grammar (on a worker thread; ConstraintError: a bad one); it is never
    advanced, only copied. Its first mask is computed here once, on a copy: the lexer states that builds are shared
    by every copy, so a row's first mask (on the way to its first token) does not build them."""
    import llguidance

    grammar = grammar_of(constraint)
    limits = llguidance.LLParserLimits(verbose_errors=False)
    ll_tokenizer = tokenizer.result()
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=limits)
    if not matcher.is_error():
        scratch = np.zeros(vocab_words(ll_tokenizer.vocab_size), dtype=np.int32)
        matcher.deep_copy().unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    return matcher


class RowConstraint:
    """A row's grammar state: its matcher (a copy of the compiled one), advanced by every committed token."""

    def __init__(self, constraint: Constraint, template: Future, n_vocab: int):
        self.constraint, self.n_vocab = constraint, n_vocab  # n_vocab: the ids a mask covers
        self._template, self._matcher = template, None

    @property
    def matcher(self):
        """The row's matcher, once compiled (waits for the compile); ConstraintDeadEnd if it could not be."""
        if self._matcher is None:
            try:
                template = self._template.result()
            except ConstraintError as exc:  # a constraint first seen by Grammars.open, and bad
                raise ConstraintDeadEnd(str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer llguidance cannot read
                raise ConstraintDeadEnd(f"the {self.constraint.name} could not be compiled: {exc}") from None
            if template.is_error():
                raise ConstraintDeadEnd(f"invalid {self.constraint.name}: {template.get_error()}")
            self._matcher = template.deep_copy()
        return self._matcher

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.matcher.is_stopped()

    def fill(self, out: np.ndarray) -> None:
        """Write the allowed-token bitmask for the next token into `out` (int32 [words]); ConstraintDeadEnd if none."""
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self.check(bool(out.any()))

    def check(self, allows_any: bool) -> None:
        """After the row's mask was computed (`allows_any`: it has a bit set): ConstraintDeadEnd at a dead end."""
        if self.matcher.is_error():
            raise ConstraintDeadEnd(f"the {self.constraint.name} matcher failed: {self.matcher.get_error()}")
        if not allows_any:
            raise ConstraintDeadEnd(f"no token can continue the output under the {self.constraint.name}")

    def advance(self, token: int) -> str | None:
        """Consume a committed token; the reason it was refused, else None."""
        if self.matcher.consume_token(token):
            return None
        return f"token {token} does not match the {self.constraint.name}: {self.matcher.get_error()}"

    def draft_masks(self, proposals: list[int]) -> np.ndarray:
        """Bitmasks [len(proposals) + 1, words]: row i allows what may follow proposals[:i]. Rows after the first
        refused proposal allow everything (verification rejects the draft there, so they are never used). The
        matcher ends where it began."""
        masks = np.full((len(proposals) + 1, vocab_words(self.n_vocab)), -1, dtype=np.int32)
        consumed = 0
        try:
            for i in range(len(proposals) + 1):
                try:
                    self.fill(masks[i])
                except ConstraintDeadEnd:
                    if i == 0:
                        raise
                    masks[i] = -1  # the draft led into a dead end: committing its tokens will report it
                    break
                if i == len(proposals) or not _allows(masks[i], proposals[i]):
                    break
                if not self.matcher.consume_token(proposals[i]):
                    break
                consumed += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return masks


def _allows(mask: np.ndarray, token: int) -> bool:
    return 0 <= token < mask.size * 32 and bool((int(mask[token // 32]) >> (token % 32)) & 1)


def next_masks(rows: list[RowConstraint | None]) -> tuple[np.ndarray, dict[int, str]]:
    """The bitmask [len(rows), words] of a batch's next tokens: each constrained row's allowed tokens, and every token
    for a free row (None) or a row at a dead end; and the dead ends (row index -> message).

    Host work (llguidance, ~10-50 us a row): the engine calls it while the device computes the step's logits. The
    rows are filled in turn, straight into one array: llguidance's LLExecutor fills them on its own threads, but
    handing the work over took 0.3-12 ms on a busy 2-core host, against ~0.2 ms for 8 rows in turn."""
    words = vocab_words(next(r for r in rows if r is not None).n_vocab)
    bitmask = np.full((len(rows), words), -1, dtype=np.int32)
    filled, dead, address = [], {}, bitmask.ctypes.data
    for i, row in enumerate(rows):
        if row is None:
            continue
        try:
            row.matcher.unsafe_compute_mask_ptr(address + i * words * 4, words * 4)
            filled.append(i)
        except ConstraintDeadEnd as exc:  # its grammar could not be compiled
            dead[i] = str(exc)
    allows_any = bitmask.any(axis=1).tolist()
    for i in filled:
        try:
            rows[i].check(allows_any[i])
        except ConstraintDeadEnd as exc:
            dead[i] = str(exc)
            bitmask[i] = -1  # the row ends: its token is never read
    return bitmask, dead


def apply_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    """Logits [n, V] with -inf for each token a row's bitmask [n, words] (int32, bit t % 32 of word t // 32) leaves
    out: the packed masks are unpacked on the device, in one compiled kernel where the backend compiles its steps."""
    global _masker
    if _masker is None:
        _masker = mx.compile(_masked) if backends.current().compile_by_default() else _masked
    return _masker(logits, bitmask)


def _masked(logits: mx.array, bitmask: mx.array) -> mx.array:
    n, v = logits.shape
    if v % 32:
        return apply_allowed(logits, allowed(bitmask, v))
    bits = (bitmask[:, : v // 32, None] >> mx.arange(32, dtype=mx.int32)) & 1  # [n, V / 32, 32]: a view of the logits
    return apply_allowed(logits.reshape(n, v // 32, 32), bits.astype(mx.bool_)).reshape(n, v)


def allowed(bitmask: np.ndarray | mx.array, vocab_size: int) -> mx.array:
    """Bitmasks [n, words] as booleans [n, vocab_size] (unpacked on the device: 1/8 the bytes to move)."""
    words = bitmask if isinstance(bitmask, mx.array) else mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(mx.bool_)
