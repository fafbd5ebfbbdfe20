"""The model zoo: presets by name, each a function that builds a forward graph."""

from __future__ import annotations

from collections.abc import Callable

from opgraph.core.errors import OpgraphError, did_you_mean
from opgraph.core.ir import Graph

from . import bert, deepseek, gemma2, gpt2, llama, nemotron_h

PRESETS: dict[str, Callable[[], Graph]] = {
    "llama3-8b": lambda: llama.build(llama.LLAMA3_8B),
    "llama3-70b": lambda: llama.build(llama.LLAMA3_70B),
    "llama3.1-405b": lambda: llama.build(llama.LLAMA3_1_405B),
    "mixtral-8x7b": lambda: llama.build(llama.MIXTRAL_8X7B),
    "qwen2-7b": lambda: llama.build(llama.QWEN2_7B),
    "gpt2": lambda: gpt2.build(gpt2.GPT2),
    "gpt3-175b": lambda: gpt2.build(gpt2.GPT3_175B),
    "llama3.2-1b": lambda: llama.build(llama.LLAMA3_2_1B),
    "gemma2-2b": lambda: gemma2.build(gemma2.GEMMA2_2B),
    "deepseek-v2-lite": lambda: deepseek.build(deepseek.DEEPSEEK_V2_LITE),
    "bert-base": lambda: bert.build(bert.BERT_BASE),
    "nemotron-3-nano": lambda: nemotron_h.build(nemotron_h.NEMOTRON_3_NANO),
    "nemotron-h-8b": lambda: nemotron_h.build(nemotron_h.NEMOTRON_H_8B),
}


def preset(name: str) -> Graph:
    """The forward graph of a named preset: `preset("llama3-8b")`."""
    try:
        make = PRESETS[name]
    except KeyError:
        raise OpgraphError(f"unknown model {name!r}{did_you_mean(name, sorted(PRESETS))}; "
                           f"choose one of: {', '.join(sorted(PRESETS))} (or see `opgraph models`)"
                           ) from None
    return make()
