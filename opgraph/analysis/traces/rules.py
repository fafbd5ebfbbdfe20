"""The kernel rule table: a kernel's name -> its category, first matching rule wins.

Categories are the one vocabulary of `opgraph.core.categories`: the roofline's names where a
kernel's name tells which it is, plus communication, memory and other.

Every rule's work per name is bounded. A rule sees at most the first ``MAX_NAME_CHARS`` characters
of a name (the words that decide a category come in the first hundred characters of every kernel
of the shared traces; template arguments make the rest). A rule's pattern must match in time at
most quadratic in that length: `pattern_cost` reads the parsed pattern and rejects a repetition
inside a repetition (``(a+)+``: exponential), more than two unbounded repetitions a search has to
combine (``a.*b.*c`` searched is cubic), back-references, and bounded repetitions whose choices
multiply past ``MAX_CHOICES``. Built-in rules obey the same bound (a test checks each). So no name
costs more than about ``MAX_NAME_CHARS ** 2`` regex steps per rule, whatever the pattern.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

# The parser `re.compile` itself uses (Python 3.11 and later): the pattern's cost is read from
# the very tree that will run.
from re import _constants as sre
from re import _parser as sre_parse

import attrs

from ...core.categories import FALLBACK
from .jsonstream import load_json
from .source import as_path, error, one_line

__all__ = ["KERNEL_RULES", "MAX_NAME_CHARS", "classify", "load_rules", "pattern_cost"]

MAX_NAME_CHARS = 1024  # what a rule sees of a kernel's name
MAX_EXPONENT = 2  # a rule's work per name grows at most as (name length) ** 2
MAX_CHOICES = 4096  # the alternatives a pattern's bounded repetitions and branches may combine
MAX_RULES_FILE_BYTES = 1_000_000

# Ordered (category, regex) rules, matched case-insensitively with re.search against the kernel
# name; the first rule that matches decides. Why the order is what it is:
# - communication and memory first: their names are unambiguous and must never be taken by a
#   later, looser pattern (an NCCL kernel name ends in "_Sum_float", a memcpy is "Memcpy DtoD").
# - attention before matmul: xFormers' "fmha_cutlassF_..." and cuDNN's
#   "..._sdpa_..._flash_fprop_..." name cutlass / fprop but are fused attention.
# - matmul before everything that names an activation: cutlass and cuDNN convolution kernels carry
#   their epilogue in the name ("..._s16816gemm_relu_...", "cudnn_ampere_scudnn_128x64_relu_...").
#   Convolutions count as matmul: implicit-GEMM (xmma fprop/dgrad/wgrad, implicit_convolve_sgemm),
#   Winograd and cuDNN's FFT convolution (fft2d_r2c / fft2d_c2r around a complex gcgemm) are all
#   the matrix-multiply work of a conv layer. cuBLAS helper kernels whose names mention cuBLAS
#   types (splitKreduce_kernel<...cublasSplitKParams>, the cuBLASLt epilogue kernel) are part of
#   the one matmul call that launched them. "gemm" must not match FBGEMM ("fbgemm_gpu::..."),
#   whose kernels are embedding and sparse-feature ops. A GEMM kernel's name does not say whether
#   it is a projection or the output head: `opgraph.core.categories.KERNELS_COVER` says it is both.
# - norm before elementwise: PyTorch runs batch norm through TensorIterator
#   ("vectorized_elementwise_kernel<...batch_norm_elementwise...>") and Inductor fuses layer norm
#   into Triton kernels ("triton_per_fused_native_layer_norm_0"); both are norm. Inductor's
#   decomposed RMSNorm is a reduction whose fused op list has a mean and an rsqrt
#   ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"; Inductor sorts the op names, so their
#   order says nothing). That rule is anchored and looks ahead for "mean", so it is linear.
# - routing: a mixture of experts' router selects the top k experts per token (PyTorch's
#   "gatherTopK" / "sbtopk", vLLM-style "topk_softmax" and "moe_align_block_size").
# - embedding before optimizer: FBGEMM fuses the optimizer into the embedding backward
#   ("split_embedding_backward_codegen_rowwise_adagrad_..."), which is embedding work.
# - the "other" rule for Triton reductions (triton_per_ = persistent reduction, triton_red_ =
#   looped reduction) stops them from reaching elementwise just because the fused op list names
#   an activation ("triton_red_fused_gelu_gelu_backward_sum_0" is a bias-gradient reduction).
#   Reductions (reduce_kernel, softmax, pooling, cub scans and sorts) stay in "other": they are
#   neither pointwise nor matrix multiplies. Softmax in particular is not attention: unfused, it
#   may be attention's or the loss's, and the name does not say which.
# - elementwise last: TensorIterator kernels (vectorized_/unrolled_elementwise_kernel, which also
#   run copies, casts and fills), Inductor pointwise kernels (triton_poi_), activation / dropout
#   kernels outside those, and torch.cat's CatArrayBatchedCopy, which like a copy reads and
#   writes each element once.
KERNEL_RULES: tuple[tuple[str, str], ...] = (
    ("communication", (
        r"nccl|rccl|(?<![a-z])all_?reduce|(?<![a-z])all_?gather|reduce_?scatter|sendrecv"
        r"|(?<![a-z])all_?to_?all|cross_device_reduce"
    )),
    ("memory", r"mem(?:cpy|set)"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention|attn"),
    # before matmul, whose conv1d it would take: mamba_ssm's SSD kernels ("_chunk_scan_fwd_kernel",
    # "_chunk_state_bwd_db_kernel", "_state_passing_fwd_kernel", "_bmm_chunk_fwd_kernel"), Mamba-1's
    # selective scan, and causal-conv1d's kernels
    ("scan", r"chunk_scan|chunk_state|state_passing|bmm_chunk|selective_scan|causal_conv1d"),
    ("matmul", (
        r"cutlass|xmma|cublas|(?<!fb)gemm|gemv|nvjet|cijk_|rocblas|hipblas"
        r"|[sh]\d*cudnn|convolve|conv_depthwise|conv[123]d|dgrad|wgrad|winograd"
        r"|fft2d_[rc]2[rc]|miopen\w*conv|triton_tem\w*mm"
    )),
    ("norm", (
        r"layer_?norm|rms_?norm|batch_?norm|group_?norm|instance_?norm|\bbn_[fb]w"
        r"|gammabeta|rowwisemoments|^triton_(?:red|per)_fused(?=\w*mean)\w*rsqrt"
    )),
    ("routing", r"topk|moe_align"),
    ("embedding", (
        r"embedding|pooled_embs|index_?select|fbgemm_gpu::|linearize_index|bounds_check_indices"
    )),
    ("optimizer", r"multi_tensor_apply|(?<!h)adam|sgd|adagrad|rmsprop"),
    (FALLBACK, r"^triton_(?:per|red)_|reduce_kernel|softmax"),
    ("elementwise", (
        r"elementwise|triton_poi_|relu|gelu|silu|swiglu|act_and_mul|dropout|catarraybatchedcopy"
    )),
)

RULE_FILE_KEYS = frozenset({"category", "pattern"})

_RULE_HINT = "each rule is a category name and a Python regular expression"


# --------------------------------------------------------------------------- bounding the work


class _TooCostly(Exception):
    """Why a pattern may take more than quadratic time on a name."""


@attrs.frozen
class _Cost:
    """Work to match a sub-pattern at one position: ``choices x length ** exponent`` steps."""

    exponent: int = 0
    choices: int = 1


def _sequence_cost(items) -> _Cost:
    """Items one after the other: backtracking multiplies what each item may try; an atomic item
    (a lookaround, an atomic group, a possessive repetition) is never re-entered, so its own
    work adds instead of multiplying."""
    exponent, atomic, choices = 0, 0, 1
    for op, av in items:
        cost, is_atomic = _item_cost(op, av)
        if is_atomic:
            atomic = max(atomic, cost.exponent)
        else:
            exponent += cost.exponent
        choices *= cost.choices
        if choices > MAX_CHOICES:
            raise _TooCostly(f"its repetitions and alternatives combine more than "
                             f"{MAX_CHOICES:,} ways")
    return _Cost(exponent + atomic, choices)


def _item_cost(op, av) -> tuple[_Cost, bool]:
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        low, high, sub = av
        inner = _sequence_cost(sub)
        if high > 1 and inner != _Cost():
            raise _TooCostly("it repeats something that itself repeats or branches, like "
                             "(a+)+ or (a|ab)*, which can take exponential time")
        unbounded = high == sre.MAXREPEAT or high > MAX_NAME_CHARS // 16
        cost = _Cost(1) if unbounded else _Cost(0, high - low + 1)
        return cost, op is sre.POSSESSIVE_REPEAT
    if op is sre.SUBPATTERN:
        return _sequence_cost(av[-1]), False
    if op is sre.ATOMIC_GROUP:
        return _sequence_cost(av), True
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return _sequence_cost(av[1]), True
    if op is sre.BRANCH:
        costs = [_sequence_cost(alternative) for alternative in av[1]]
        return _Cost(max(c.exponent for c in costs), sum(c.choices for c in costs)), False
    if op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
        raise _TooCostly("it has a back-reference, which kernel rules do not need")
    return _Cost(), False


def _search_exponent(items) -> int:
    """`re.search` tries every start unless the pattern (or each branch of it) starts at ^."""
    items = list(items)
    if items and items[0] == (sre.AT, sre.AT_BEGINNING):
        return _sequence_cost(items).exponent
    if len(items) == 1 and items[0][0] is sre.BRANCH:
        return max(_search_exponent(alternative) for alternative in items[0][1][1])
    if len(items) == 1 and items[0][0] is sre.SUBPATTERN:
        return _search_exponent(items[0][1][-1])
    return _sequence_cost(items).exponent + 1


def pattern_cost(pattern: str) -> int:
    """How the work of ``re.search(pattern, name)`` can grow: as len(name) ** the result.

    Raises ValueError saying why when it can grow faster than ``MAX_EXPONENT`` allows, or when
    the pattern does not compile.

    >>> pattern_cost("nccl"), pattern_cost(r"miopen\\w*conv"), pattern_cost(r"^a\\w*b(?=\\w*c)")
    (1, 2, 2)
    >>> pattern_cost("(a+)+$")
    Traceback (most recent call last):
    ...
    ValueError: it repeats something that itself repeats or branches, like (a+)+ or (a|ab)*, which can take exponential time
    """
    try:
        parsed = sre_parse.parse(pattern, re.IGNORECASE)
        if parsed.state.flags & re.MULTILINE:  # ^ then matches after every newline: not a fence
            exponent = _sequence_cost(parsed).exponent + 1
        else:
            exponent = _search_exponent(parsed)
    except _TooCostly as why:
        raise ValueError(str(why)) from None
    except (re.error, RecursionError) as err:
        raise ValueError(f"it does not compile ({one_line(err)})") from None
    if exponent > MAX_EXPONENT:
        raise ValueError(f"its work grows as the name's length to the power {exponent} (more "
                         f"than {MAX_EXPONENT} unbounded repetitions a search must combine, like "
                         "a.*b.*c); use lookaheads, a(?=.*b)(?=.*c), or split it into rules")
    return exponent


# --------------------------------------------------------------------------- classifying


@functools.lru_cache(maxsize=64)
def _compile_rules(rules: tuple) -> tuple[tuple[str, re.Pattern], ...]:
    """Check and compile a rules table once per distinct table; case-insensitive."""
    compiled = []
    for index, rule in enumerate(rules, start=1):
        where = f"kernel rule {index}"
        if not isinstance(rule, tuple) or len(rule) != 2:
            raise error(f"{where} is {rule!r}, not a (category, pattern) pair: {_RULE_HINT}")
        category, pattern = rule
        if not isinstance(category, str) or not category:
            raise error(f"{where} has category {category!r}, not a non-empty string: "
                        f"{_RULE_HINT}")
        if isinstance(pattern, re.Pattern):
            pattern = pattern.pattern
        if not isinstance(pattern, str):
            raise error(f"{where} has pattern {pattern!r}, not a string: {_RULE_HINT}")
        try:
            pattern_cost(pattern)
        except ValueError as why:
            raise error(f"{where} has a pattern {pattern!r} that cannot be used: {why}") from None
        compiled.append((category, re.compile(pattern, re.IGNORECASE)))
    return tuple(compiled)


def _hashable_rules(rules: Iterable) -> tuple:
    """The rules as a tuple of pairs, so that tables given as lists can be cached too."""
    table = tuple(tuple(rule) if isinstance(rule, list) else rule for rule in rules)
    try:
        hash(table)
    except TypeError:
        raise error("kernel rules must be (category, pattern) pairs of strings") from None
    return table


def compile_rules(rules: Iterable = KERNEL_RULES) -> tuple[tuple[str, re.Pattern], ...]:
    """The checked, compiled table `first_match` takes; OpgraphError for a bad rule."""
    return _compile_rules(_hashable_rules(rules))


def first_match(name: str, compiled: Sequence[tuple[str, re.Pattern]]) -> str:
    """The category of the first compiled rule matching (the start of) `name`, else "other"."""
    name = name[:MAX_NAME_CHARS]
    for category, regex in compiled:
        if regex.search(name):
            return category
    return FALLBACK


@functools.lru_cache(maxsize=65536)
def _classify_cached(name: str, rules: tuple) -> str:
    return first_match(name, _compile_rules(rules))


def classify(name: str, rules: Iterable = KERNEL_RULES) -> str:
    """The category of a kernel name: the first rule whose regex matches it, else ``"other"``.

    Put your own rules in front of the defaults to override them.

    >>> classify("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(...)")
    'matmul'
    >>> classify("my_fused_rope", rules=(("rope", r"my_fused"),) + KERNEL_RULES)
    'rope'
    """
    return _classify_cached(name, _hashable_rules(rules))


def load_rules(path: str | Path, base: Iterable = KERNEL_RULES) -> tuple[tuple[str, str], ...]:
    """Read extra rules from a JSON file and return them followed by ``base`` (the defaults).

    The file holds ``[{"category": "rope", "pattern": "rotary|rope_"}, ...]``; its rules come
    first, so they win over the defaults. Pass ``base=()`` to get the file's rules alone.
    Raises OpgraphError with a one-line message for an unreadable or oversized file, a wrong
    shape, or a regular expression that is bad or could take too long (`pattern_cost`).

    Example::

        rules = load_rules("rules.json")     # rules[0] == ('rope', 'rotary|rope_')
        breakdown(iter_kernels("trace.json.gz"), rules)
    """
    path = as_path(path, "rules file")
    hint = 'write a list like [{"category": "rope", "pattern": "rotary"}]'
    document = load_json(path, "rules file", MAX_RULES_FILE_BYTES, hint)
    if not isinstance(document, list):
        kind = type(document).__name__
        raise error(f"{path} is not a rules file (the top level is a {kind}): {hint}")
    rules = []
    for index, item in enumerate(document, start=1):
        where = f"{path}: rule {index}"
        if not isinstance(item, dict) or set(item) != RULE_FILE_KEYS:
            shown = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise error(f'{where} must be an object with exactly "category" and "pattern" '
                        f"(got {shown}): {hint}")
        category, pattern = item["category"], item["pattern"]
        if not isinstance(category, str) or not category.strip():
            raise error(f"{where} has category {category!r}, not a non-empty string: {hint}")
        if not isinstance(pattern, str):
            raise error(f"{where} has pattern {pattern!r}, not a string: {hint}")
        try:
            pattern_cost(pattern)
        except ValueError as why:
            raise error(f"{where} has a pattern {pattern!r} that cannot be used: {why}; "
                        "fix the regular expression") from None
        rules.append((category.strip(), pattern))
    return tuple(rules) + _hashable_rules(base)
