"""What a parity run is fed: a model (checkpoint, config with random weights, or an architecture's
embedded example) and token sequences.

Random weights come from :func:`mcore_zoo.parity.reference.write_reference_checkpoint` (sharp
attention, every parameter distinct) and are saved with ``save_pretrained``: the reference is then
loaded with ``from_pretrained(dtype=...)`` exactly like a real checkpoint (DESIGN's parity traps).

:func:`scale_config` shrinks a published config (``--scale tiny|small``) while keeping what
decides the numerics: the GQA ratio, ``head_dim``, RoPE (type, base, scaling), biases, norms, tied
embeddings, sliding windows. Only depth, the number of heads (hence the width), the MLP width,
the number of routed experts where one layer's would exceed :data:`MAX_EXPERT_PARAMS` and, for
``tiny``, the vocabulary change (a vision-language config: those of its ``text_config``, and its
vision tower, which the zoo does not build, shrinks to one small block); every change is recorded
in the report.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import ZooError

#: preset -> (layers, largest hidden size, largest vocabulary or None)
SCALES: dict[str, tuple[int, int, Optional[int]]] = {
    "tiny": (2, 512, 512),
    "small": (8, 1024, None),
}

#: Fields a random-weight reference checkpoint cannot carry, and what it gets instead (recorded in
#: the report's ``changes``): the weights are generated in the training dtype, not block-quantized
#: (an FP8 ``quantization_config`` would describe tensors that are not there; the zoo's FP8 loading
#: is tested against real FP8 files); transformers' models build no multi-token-prediction layers,
#: so the checkpoint they write has none for the zoo's MTP block to load, nor a reference to compare
#: its logits with (the MTP block is tested against a reference of DeepSeek-V3's definition, and
#: it leaves the main logits bitwise unchanged: ``tests/parity/test_mtp_parity.py``).
RANDOM_WEIGHTS_CANNOT_CARRY: dict[str, Any] = {"quantization_config": None, "num_nextn_predict_layers": 0,
                                               "mtp_num_hidden_layers": 0}
#: where a vision-language config nests its language model's fields
TEXT_CONFIG = "text_config"
#: a vision tower shrunk to one small block for ``--scale``, its output width that of the scaled
#: language model (the zoo builds Qwen2.5-VL's and Qwen3-VL's towers; of the other vision-language
#: checkpoints it loads the language model alone); a tower with deepstack mergers keeps one, fed
#: by that block
TINY_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}


def language_model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the language model's fields: a vision-language config's ``text_config``,
    else the config itself."""
    text = config.get(TEXT_CONFIG)
    return text if isinstance(text, dict) else config

#: Published configs of one real model per built-in architecture (``--arch X --scale ...``).
PUBLISHED = Path(__file__).parent / "configs"

#: Text tokenized when a checkpoint ships a tokenizer (public-domain English, several registers).
SAMPLE_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of"
    " foolishness, it was the epoch of belief, it was the epoch of incredulity.\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "The mitochondrion is a double-membrane-bound organelle found in most eukaryotic organisms; it"
    " generates most of the cell's supply of adenosine triphosphate, used as a source of chemical energy.\n"
    "Question: what is 17 * 23? Answer: 17 * 23 = 391, because 17 * 20 = 340 and 17 * 3 = 51.\n"
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my"
    " purse, and nothing particular to interest me on shore, I thought I would sail about a little.\n"
)


@dataclass
class ModelSource:
    """The model of a parity run.

    Attributes:
        architecture: the registry's :class:`~mcore_zoo.architecture.Architecture`.
        checkpoint: HF checkpoint directory that both the reference and the mcore model load.
        kind: ``"checkpoint"`` (``--model``), ``"config"`` (``--config --random-weights``) or
            ``"example"`` (the architecture's embedded tiny config).
        origin: path or description of where the config came from.
        random_weights: the weights were generated (seeded) by the harness.
        scale: the ``--scale`` preset applied, if any.
        changes: config fields changed by ``--scale`` / ``--set``: ``{field: [old, new]}``.
        tokenizer: directory holding a tokenizer, if any.
        config: the HF config dict the checkpoint carries.
    """

    architecture: Any
    checkpoint: Path
    kind: str
    origin: str
    random_weights: bool
    seed: int = 0
    scale: Optional[str] = None
    changes: dict[str, list[Any]] = field(default_factory=dict)
    tokenizer: Optional[Path] = None
    config: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        c = language_model_fields(self.config)
        heads = c.get("num_attention_heads")
        return {
            "architecture": self.architecture.name,
            "provided_by": self.architecture.origin,
            "kind": self.kind,
            "origin": self.origin,
            "random_weights": self.random_weights,
            "seed": self.seed if self.random_weights else None,
            "scale": self.scale,
            "changes": self.changes,
            "shape": {
                "layers": c.get("num_hidden_layers"),
                "hidden": c.get("hidden_size"),
                "intermediate": c.get("intermediate_size"),
                "heads": heads,
                "kv_heads": c.get("num_key_value_heads", heads),
                "head_dim": c.get("head_dim") or (c.get("hidden_size", 0) // heads if heads else None),
                "vocab": c.get("vocab_size"),
                "tied_embeddings": c.get("tie_word_embeddings"),
            },
        }


def _set_path(config: dict[str, Any], key: str, value: Any, changes: dict[str, list[Any]]) -> None:
    old = config.get(key)
    if old != value:
        changes.setdefault(key, [old, value])
        changes[key][1] = value
        config[key] = value


def _set_setting(config: dict[str, Any], key: str, value: Any, changes: dict[str, list[Any]]) -> None:
    """One ``--set KEY=VALUE``: ``KEY`` names a top-level field, or a field of a nested config as
    ``text_config.<field>`` / ``vision_config.<field>`` (a vision-language config's language model
    or vision tower); the change is recorded under ``KEY``."""
    parent, dot, field = key.rpartition(".")
    if not dot or key in config:
        _set_path(config, key, value, changes)
        return
    nested = config.get(parent)
    if not isinstance(nested, dict):
        raise ZooError(f"--set {key}: the config has no nested {parent!r} object")
    nested = config[parent] = dict(nested)
    old = nested.get(field)
    if old != value:
        changes.setdefault(key, [old, value])
        changes[key][1] = value
        nested[field] = value


def _scale_width(c: dict[str, Any], factor: float, changes: dict[str, list[Any]]) -> None:
    """MLP widths (dense and per expert) shrink by the factor of the heads."""
    if "intermediate_size" in c:
        inter = max(64, int(math.ceil(c["intermediate_size"] * factor / 64)) * 64)
        _set_path(c, "intermediate_size", inter, changes)
    if isinstance(c.get("moe_intermediate_size"), int):
        moe = max(32, int(math.ceil(c["moe_intermediate_size"] * factor / 32)) * 32)
        _set_path(c, "moe_intermediate_size", moe, changes)


def _scale_heads(c: dict[str, Any], max_hidden: int, changes: dict[str, list[Any]]) -> None:
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    if heads % kv:
        raise ZooError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    ratio = heads // kv
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    new_kv = 1
    for candidate in range(min(kv, 8), 0, -1):
        if candidate * ratio * head_dim * hidden // (heads * head_dim) <= max_hidden:
            new_kv = candidate
            break
    new_heads = new_kv * ratio
    factor = new_heads / heads
    new_hidden = hidden * new_heads // heads
    if "head_dim" in c or new_hidden // new_heads != head_dim:
        _set_path(c, "head_dim", head_dim, changes)  # keep head_dim explicit where it was derived
    _set_path(c, "num_attention_heads", new_heads, changes)
    _set_path(c, "num_key_value_heads", new_kv, changes)
    _set_path(c, "hidden_size", new_hidden, changes)
    _scale_width(c, factor, changes)


def _scale_mla(c: dict[str, Any], max_hidden: int, changes: dict[str, list[Any]]) -> None:
    """Multi-head latent attention (DeepSeek): the per-head widths (``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``) and ``kv_lora_rank`` are kept; up to 4 heads (2+ so that
    TP=2 stays possible); the hidden size, ``q_lora_rank`` and MLP widths shrink by one factor."""
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    new_heads = min(heads, 4)
    new_hidden = min(hidden, max_hidden)
    factor = new_hidden / hidden
    _set_path(c, "num_attention_heads", new_heads, changes)
    if c.get("num_key_value_heads") is not None:
        _set_path(c, "num_key_value_heads", new_heads, changes)  # MLA: one key / value per head
    _set_path(c, "hidden_size", new_hidden, changes)
    if isinstance(c.get("q_lora_rank"), int):
        _set_path(c, "q_lora_rank", max(16, int(math.ceil(c["q_lora_rank"] * factor / 16)) * 16), changes)
    _scale_width(c, factor, changes)


#: the routed experts' weights of one layer a scaled config may keep (parameters); beyond it the
#: number of experts halves (512 experts of a 1024-wide model would need gigabytes on the CPU)
MAX_EXPERT_PARAMS = 100_000_000
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


def _cap_experts(c: dict[str, Any], changes: dict[str, list[Any]]) -> None:
    """Halve the number of routed experts until one layer's experts fit :data:`MAX_EXPERT_PARAMS`
    (the top-k is kept: it stays below the number of experts)."""
    name = next((f for f in EXPERT_FIELDS if isinstance(c.get(f), int) and c[f] > 0), None)
    width = c.get("moe_intermediate_size") or c.get("intermediate_size")
    if name is None or not isinstance(width, int):
        return
    experts, top_k = c[name], int(c.get("num_experts_per_tok") or 1)
    while experts * 3 * width * int(c["hidden_size"]) > MAX_EXPERT_PARAMS and experts % 2 == 0 and experts // 2 > top_k:
        experts //= 2
    _set_path(c, name, experts, changes)


def _scale_hybrid_layers(c: dict[str, Any], new_layers: int, changes: dict[str, list[Any]]) -> None:
    """Gated DeltaNet models (``full_attention_interval``): the interval shrinks to the kept depth,
    so the last kept layer is a full-attention one and the others gated DeltaNet layers (transformers
    derives ``layer_types`` from it where the config has none)."""
    interval = c.get("full_attention_interval")
    if isinstance(interval, int) and interval > new_layers:
        _set_path(c, "full_attention_interval", new_layers, changes)
        if isinstance(c.get("layer_types"), list):
            kinds = ["linear_attention"] * (new_layers - 1) + ["full_attention"]
            _set_path(c, "layer_types", kinds, changes)


def _scale_vision_language(config: dict[str, Any], preset: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """A vision-language config: its ``text_config`` scaled as a text model's config, its vision
    tower shrunk to :data:`TINY_VISION` with the output width of the scaled language model; the
    changes are named ``text_config.<field>`` / ``vision_config.<field>``."""
    c = dict(config)
    text, text_changes = scale_config(c[TEXT_CONFIG], preset)
    changes = {f"{TEXT_CONFIG}.{k}": v for k, v in text_changes.items()}
    c[TEXT_CONFIG] = text
    _shrink_vision_tower(c, text["hidden_size"], changes)
    if SCALES[preset][2] is not None:
        _marker_tokens_in_vocabulary(c, int(text["vocab_size"]), changes)
    return c, changes


def _shrink_vision_tower(c: dict[str, Any], hidden_size: int, changes: dict[str, list[Any]]) -> None:
    """``c["vision_config"]`` (if any) shrunk to :data:`TINY_VISION`, output width ``hidden_size``;
    the changes named ``vision_config.<field>``."""
    if not isinstance(c.get("vision_config"), dict):
        return
    vision = dict(c["vision_config"])
    vision_changes: dict[str, list[Any]] = {}
    for key, value in {**TINY_VISION, "out_hidden_size": hidden_size}.items():
        _set_path(vision, key, value, vision_changes)
    if vision.get("deepstack_visual_indexes"):
        _set_path(vision, "deepstack_visual_indexes", [0], vision_changes)
    c["vision_config"] = vision
    changes.update({f"vision_config.{k}": v for k, v in vision_changes.items()})


def scale_config(config: dict[str, Any], preset: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Shrink ``config`` with preset ``tiny`` or ``small`` (see module docstring).

    Heads: the largest number of key/value heads (at most the original, at least 1, preferring 2+
    so that TP=2 stays possible) whose ``heads * head_dim`` fits the preset's width; query heads
    keep the GQA ratio. Hidden and MLP widths shrink by the same factor as the heads. A gated
    DeltaNet model keeps one layer of each kind; a vision-language config is scaled in its
    ``text_config`` (:func:`_scale_vision_language`), or at the top level where its text fields
    are (Qwen2.5-VL's published form), its vision tower shrunk (:func:`_shrink_vision_tower`).
    """
    if preset not in SCALES:
        raise ZooError(f"unknown --scale {preset!r}; known: {sorted(SCALES)}")
    if isinstance(config.get(TEXT_CONFIG), dict):
        return _scale_vision_language(config, preset)
    layers, max_hidden, max_vocab = SCALES[preset]
    c = dict(config)
    changes: dict[str, list[Any]] = {}
    if c.get("kv_lora_rank") is not None:
        _scale_mla(c, max_hidden, changes)
    else:
        _scale_heads(c, max_hidden, changes)
    old_layers = int(c["num_hidden_layers"])
    new_layers = min(layers, old_layers)
    _set_path(c, "num_hidden_layers", new_layers, changes)
    first_dense = c.get("first_k_dense_replace")
    if isinstance(first_dense, int) and first_dense >= new_layers > 1:  # keep one dense and >= 1 MoE layer
        _set_path(c, "first_k_dense_replace", min(first_dense, new_layers - 1), changes)
    if isinstance(c.get("layer_types"), list):
        _set_path(c, "layer_types", list(c["layer_types"][:new_layers]), changes)
    _scale_hybrid_layers(c, new_layers, changes)
    _cap_experts(c, changes)
    if isinstance(c.get("max_window_layers"), int) and c["max_window_layers"] >= old_layers:
        _set_path(c, "max_window_layers", new_layers, changes)
    elif isinstance(c.get("max_window_layers"), int):
        _set_path(c, "max_window_layers", max(0, c["max_window_layers"] * new_layers // old_layers), changes)
    if max_vocab is not None and int(c["vocab_size"]) > max_vocab:
        _set_path(c, "vocab_size", max_vocab, changes)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = c.get(key)
            if isinstance(value, int) and value >= max_vocab:
                _set_path(c, key, max_vocab - 1, changes)
            elif isinstance(value, list):
                _set_path(c, key, [min(v, max_vocab - 1) for v in value], changes)
    _shrink_vision_tower(c, int(c["hidden_size"]), changes)  # a vision-language config with top-level text fields
    if max_vocab is not None and isinstance(c.get("vision_config"), dict):
        _marker_tokens_in_vocabulary(c, int(c["vocab_size"]), changes)
    return c, changes


#: the top-level ids of Qwen-VL configs' image / video marker tokens, kept inside a shrunk vocabulary
MARKER_TOKEN_FIELDS = ("vision_start_token_id", "vision_end_token_id", "vision_token_id", "image_token_id",
                       "video_token_id")  # fmt: skip


def _marker_tokens_in_vocabulary(c: dict[str, Any], vocab_size: int, changes: dict[str, list[Any]]) -> None:
    """Marker-token ids at or past ``vocab_size`` moved to distinct ids at its end (images can then
    be fed to the shrunk model)."""
    for k, key in enumerate(MARKER_TOKEN_FIELDS):
        if isinstance(c.get(key), int) and c[key] >= vocab_size:
            _set_path(c, key, vocab_size - 2 - len(MARKER_TOKEN_FIELDS) + k, changes)


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` (values parsed as JSON when possible) -> dict."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ZooError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def _drop_what_random_weights_cannot_carry(raw: dict[str, Any], settings: dict[str, Any],
                                           changes: dict[str, list[Any]]) -> None:  # fmt: skip
    """:data:`RANDOM_WEIGHTS_CANNOT_CARRY` applied to the config and to a vision-language config's
    ``text_config`` (changes named ``text_config.<field>``); fields set with ``--set`` are kept."""
    for key, value in RANDOM_WEIGHTS_CANNOT_CARRY.items():
        if raw.get(key) and key not in settings:
            _set_path(raw, key, value, changes)
    if language_model_fields(raw) is raw:
        return
    text, text_changes = dict(raw[TEXT_CONFIG]), {}
    for key, value in RANDOM_WEIGHTS_CANNOT_CARRY.items():
        if text.get(key) and f"{TEXT_CONFIG}.{key}" not in settings:
            _set_path(text, key, value, text_changes)
    raw[TEXT_CONFIG] = text
    changes.update({f"{TEXT_CONFIG}.{k}": v for k, v in text_changes.items()})


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def prepare_model(
    *,
    arch: Optional[str] = None,
    model: Optional[str] = None,
    config: Optional[str] = None,
    random_weights: bool = False,
    scale: Optional[str] = None,
    settings: Optional[dict[str, Any]] = None,
    dtype: torch.dtype = torch.float32,
    work_dir: Path,
    seed: int = 0,
) -> ModelSource:
    """Resolve the model of a run; writes a random-weight checkpoint under ``work_dir`` if needed.

    Exactly one of ``model`` (HF checkpoint dir), ``config`` (config.json or dir; needs
    ``random_weights``) or ``arch`` (its embedded example, or with ``scale`` its published config
    shipped in ``parity/configs``) must be given. ``settings`` (``--set``) override config fields.
    """
    from ..config.normalize import read_json_config
    from ..registry import get_registry, lookup
    from .reference import write_reference_checkpoint

    given = [name for name, value in (("--model", model), ("--config", config), ("--arch", arch)) if value]
    if len(given) != 1:
        raise ZooError("give exactly one of --arch NAME, --config PATH --random-weights, --model DIR"
                       + (f" (got {', '.join(given)})" if given else ""))  # fmt: skip
    settings = dict(settings or {})
    if model is not None and not random_weights:
        if scale or settings:
            raise ZooError("--scale / --set change the config, so they need random weights:"
                           " use --config PATH --random-weights (or --model DIR --random-weights)")  # fmt: skip
        from ..hub import resolve

        path = Path(resolve(model))
        if not path.is_dir():
            raise FileNotFoundError(f"--model {model}: not a checkpoint directory")
        architecture = lookup(str(path))
        from ..weights.io import HFCheckpoint

        HFCheckpoint(path).close()  # headers, index, no pickle: before transformers reads a byte
        return ModelSource(
            architecture, path, "checkpoint", str(path), False,
            tokenizer=path if _has_tokenizer(path) else None, config=read_json_config(path),
        )  # fmt: skip
    if model is not None:
        config = model
    if config is not None:
        if not random_weights:
            raise ZooError(f"--config {config}: a config has no weights; add --random-weights (or use --model DIR)")
        raw = read_json_config(config)
        architecture = lookup(raw)
        kind, origin = "config", str(config)
    else:
        architecture = get_registry().get(arch)
        kind = "example"
        if scale:
            published = PUBLISHED / f"{architecture.name}.json"
            if not published.is_file():
                raise ZooError(
                    f"--scale with --arch {architecture.name}: no published config is shipped for it;"
                    " pass --config PATH --random-weights --scale ..."
                )
            raw = read_json_config(published)
            kind, origin = "config", f"published config shipped with mcore-zoo ({published.name}: {raw.get('_source', '')})"
            raw.pop("_source", None)
        else:
            raw = architecture.example_config()
            origin = f"embedded example config of {architecture.name}"
    changes: dict[str, list[Any]] = {}
    if scale:
        raw, changes = scale_config(raw, scale)
    for key, value in settings.items():
        _set_setting(raw, key, value, changes)
    _drop_what_random_weights_cannot_carry(raw, settings, changes)
    out = Path(work_dir) / "reference"
    write_reference_checkpoint(architecture, raw, out, seed=seed, dtype=dtype)
    saved = read_json_config(out)
    tokenizer = None
    if model is not None and _has_tokenizer(Path(model)) and not changes.get("vocab_size"):
        tokenizer = Path(model)
    return ModelSource(architecture, out, kind, origin, True, seed, scale, changes, tokenizer, saved)


def make_sequences(
    lengths: list[int],
    vocab_size: int,
    *,
    tokenizer: Optional[Path] = None,
    mode: str = "auto",
    seed: int = 0,
    trust_remote_code: bool = False,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Token sequences of the given lengths and a description for the report.

    ``mode``: ``"auto"`` (the tokenizer's encoding of :data:`SAMPLE_TEXT` when a tokenizer is
    present, else seeded random ids), ``"tokenizer"`` (required) or ``"random"``. Sequences are
    consecutive windows of the encoded text (wrapping around).
    """
    if not lengths or min(lengths) < 2:
        raise ZooError(f"--lengths {lengths}: every sequence needs at least 2 tokens")
    if mode not in ("auto", "tokenizer", "random"):
        raise ZooError(f"unknown --tokens {mode!r}; use auto, tokenizer or random")
    if mode == "tokenizer" and tokenizer is None:
        raise ZooError("--tokens tokenizer: the model has no tokenizer files")
    fallback = None
    if tokenizer is not None and mode != "random":
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=trust_remote_code)
            ids = tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
            if max(ids) >= vocab_size:
                raise ZooError(f"tokenizer {tokenizer} produces id {max(ids)} >= vocab_size {vocab_size}")
        except Exception as exc:
            if mode == "tokenizer":
                raise ZooError(f"--tokens tokenizer: cannot use the tokenizer in {tokenizer}: {exc}") from exc
            fallback = f"tokenizer in {tokenizer} not usable ({type(exc).__name__}: {exc}); random ids instead"
            tokenizer = None
    if tokenizer is not None and mode != "random":
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        stream = ids * (1 + max(lengths) * len(lengths) // max(1, len(ids)))
        seqs, offset = [], 0
        for n in lengths:
            body = (bos + stream[offset : offset + n])[:n]
            offset += n
            seqs.append(torch.tensor(body, dtype=torch.long))
        return seqs, {"source": "tokenizer", "tokenizer": str(tokenizer), "lengths": lengths,
                      "total_tokens": sum(lengths), "text": "built-in sample text", "_decode": tok}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    info: dict[str, Any] = {"source": "random", "seed": seed, "lengths": lengths, "total_tokens": sum(lengths)}
    if fallback:
        info["note"] = fallback
    return seqs, info


def add_images(sequences: list[torch.Tensor], vision: Any, *, seed: int = 0, side: Optional[int] = None,
               images: int = 1) -> tuple[list[torch.Tensor], list[Optional[dict]], dict[str, Any]]:  # fmt: skip
    """``images`` images of random pixels in every sequence long enough for them (a vision-language
    model whose tower the zoo builds; ``vision``: its :class:`~mcore_zoo.config.arch.VisionSpec`).

    Each image's tokens (start marker, one image token per merged feature, end marker) replace a
    stretch of the sequence, its length unchanged, the images spread evenly over it; an image is a
    grid of ``side x side`` merged features, or (``side=None``) alternately ``2 x 2`` and ``2 x 4``
    per sequence. A sequence too short for all of them gets none. Marker ids drawn as random text
    become id 0. Returns the sequences, per sequence its vision inputs (``None``: text only; the
    keys of transformers' processor) and a description for the report."""
    if images < 1:
        raise ZooError(f"--images {images}: 0 (text only) or more images per sequence")
    merge = vision.spatial_merge_size
    values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    markers = torch.tensor([vision.vision_start_token_id, vision.image_token_id, vision.video_token_id,
                            vision.vision_end_token_id])  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    out, inputs, grids = [], [], []
    for i, seq in enumerate(sequences):
        seq = torch.where(torch.isin(seq, markers), torch.zeros_like(seq), seq)
        rows, cols = (side, side) if side else (2, 2 if i % 2 == 0 else 4)
        grid = (1, rows * merge, cols * merge)
        tokens = grid[0] * grid[1] * grid[2] // merge**2
        stride = seq.numel() // images
        if stride < tokens + 4:
            out.append(seq)
            inputs.append(None)
            continue
        image = torch.cat([torch.tensor([vision.vision_start_token_id]), torch.full((tokens,), vision.image_token_id),
                           torch.tensor([vision.vision_end_token_id])])  # fmt: skip
        for k in range(images):
            start = k * stride + (stride - image.numel()) // 2
            seq = torch.cat([seq[:start], image, seq[start + image.numel():]])
        out.append(seq)
        pixels = torch.randn(images * grid[0] * grid[1] * grid[2], values, generator=gen)
        inputs.append({"pixel_values": pixels, "image_grid_thw": torch.tensor([grid] * images)})
        grids += [list(grid)] * images
    info = {"images": len(grids), "image_grid_thw": grids, "pixels": f"random normal (seed {seed + 1})",
            "sequences_with_an_image": [i for i, v in enumerate(inputs) if v is not None]}  # fmt: skip
    return out, inputs, info
