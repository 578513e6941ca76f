"""The mcore-zoo conformance suite for this plugin: every contract, for the example config and the
variants below, against transformers' Phi3ForCausalLM."""

from mcore_zoo.testing import ConformanceSuite


class TestPhi3Conformance(ConformanceSuite):
    plugin = "phi3"
    variants = {
        "Phi3ForCausalLM": {
            # Phi-4-mini-like: partial rotary, tied embeddings, no sliding window
            "partial-rotary-tied": {"partial_rotary_factor": 0.5, "tie_word_embeddings": True, "sliding_window": None},
        }
    }
    rejected = {
        "Phi3ForCausalLM": {
            "longrope": {
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
                "original_max_position_embeddings": 128,
            },
            "resid-dropout": {"resid_pdrop": 0.1},
        }
    }
