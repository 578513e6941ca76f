"""Shared fixtures: a single-process Megatron parallel state, tiny reference checkpoints, cases."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = FIXTURES / "configs"

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]

#: (id, architecture, overrides of the embedded example config): every built-in family plus the
#: variants that take other code paths (tied embeddings, biases, per-layer sliding window).
CASES = [
    ("llama3", "LlamaForCausalLM", {}),
    ("llama-tied-default-rope", "LlamaForCausalLM", {"rope_scaling": None, "tie_word_embeddings": True}),
    ("llama-bias", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("mistral-swa", "MistralForCausalLM", {}),
    ("qwen2-tied", "Qwen2ForCausalLM", {}),
    (
        "qwen2-swa-mixed",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "num_hidden_layers": 3},
    ),
    ("qwen3", "Qwen3ForCausalLM", {}),
]
CASE_IDS = [c[0] for c in CASES]


def case_config(arch_name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    import mcore_zoo

    config = mcore_zoo.lookup(arch_name).example_config()
    config.update(overrides)
    return config


@pytest.fixture(scope="session")
def mpu() -> Any:
    """Megatron parallel state for this (single) process: gloo, everything 1."""
    from mcore_zoo.parallel import ensure_model_parallel

    return ensure_model_parallel()


@pytest.fixture(scope="session")
def reference_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``reference_checkpoint(arch_name, overrides={}, seed=0) -> dir``: an HF checkpoint with
    random, sharp-attention weights (cached per session)."""
    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint

    cache: dict[Any, Path] = {}

    def make(arch_name: str, overrides: dict[str, Any] | None = None, seed: int = 0) -> Path:
        overrides = overrides or {}
        key = (arch_name, repr(sorted(overrides.items())), seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(arch_name)
            write_reference_checkpoint(mcore_zoo.lookup(arch_name), case_config(arch_name, overrides), out, seed=seed)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture
def hf_reference() -> Callable[..., torch.nn.Module]:
    import mcore_zoo
    from mcore_zoo.parity.reference import load_reference

    def load(arch_name: str, checkpoint: Path, attn: str = "eager") -> torch.nn.Module:
        return load_reference(mcore_zoo.lookup(arch_name), checkpoint, attn_implementation=attn)

    return load


def random_sequences(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
