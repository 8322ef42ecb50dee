"""Hugging Face models from a config.json, with random weights, never downloading anything.

The model class comes from the config's ``architectures`` (when transformers knows it and it is a
causal LM, seq2seq LM, masked LM or classification class), else from the model type through the
auto mappings: seq2seq LM first for encoder-decoders, masked LM first for types that have one
(encoders), else causal LM, seq2seq LM, masked LM, image classification, sequence classification.
The class fixes the task and so the synthetic batch and the loss (see docs/ingest.md).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.errors import MeshplanError
from meshplan.ingest.batch import Batch, class_logits, token_ce
from meshplan.ingest.source import Source, read_hf_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TASK_MAPPINGS = (  # (auto mapping, task) in the order tried when the architecture is not given/known
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-lm"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq-lm"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked-lm"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "classification"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "classification"),
)
DEFAULT_SEQ_LEN = 2048
"""Sequence length when neither the caller nor the config gives one."""
MAX_DEFAULT_SEQ_LEN = 8192
"""The config's maximum positions is the default sequence length, capped at this."""
SEQ2SEQ_DEFAULT_SEQ_LEN = 512
"""Encoder-decoders without learned positions (T5): the pre-training length."""
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")
ARCH_FIELDS = (  # (what, the names families give it): the fields that define an architecture
    ("hidden size", ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim")),
    ("layers", ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers")),
    ("attention heads", ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")),
    ("vocabulary", ("vocab_size",)),
    ("MLP width", ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "ffn_hidden_size",
                   "hidden_dim")),
    ("experts", ("num_local_experts", "num_experts", "n_routed_experts")),
    ("experts per token", ("num_experts_per_tok",)),
    ("decoder layers", ("decoder_layers",)),
    ("decoder attention heads", ("decoder_attention_heads",)),
    ("decoder MLP width", ("decoder_ffn_dim",)),
)
"""A config that leaves one of these to the config class's default describes the class's default
model, not the user's: ingestion refuses it (``missing_arch_fields``). A family is asked only for
the names its config class takes (its ``__init__`` parameters, or their ``attribute_map`` aliases),
and not for one whose default is None (derived from the others: GPT-2's ``n_inner`` = 4 x n_embd)."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MeshplanError("hf: sources need the transformers package",
                            hint="pip install 'meshplan[ingest]' (or pip install transformers)") from None
    return transformers


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings (config sanity checks, deprecations) while building."""
    tf = _transformers()
    old = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()
    try:
        yield
    finally:
        tf.logging.set_verbosity(old)


@contextlib.contextmanager
def meta_patches() -> Iterator[None]:
    """transformers code that reads tensor values on the way, made shape-only for the trace.

    ``transformers.masking_utils`` checks attention masks and position ids with ``bool(tensor)``
    ("is every token unmasked?", "is the batch unpacked?"): for the synthetic batch (no padding, one
    sequence per row) the answer is True, so those checks answer True while tracing."""
    from meshplan.ingest import trace

    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - old transformers
        yield
        return
    path = masking_utils.__file__
    added = path not in trace.ASSUME_TRUE
    trace.ASSUME_TRUE.add(path)
    try:
        yield
    finally:
        if added:
            trace.ASSUME_TRUE.discard(path)


def load_config(src: Source) -> Any:
    """The transformers config object of an hf: source."""
    assert src.path is not None
    data = read_hf_config(src.path)
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    mt = data["model_type"]
    if mt not in CONFIG_MAPPING:
        raise MeshplanError(f"{str(src.path)!r}: model_type {mt!r} is not known to transformers {tf.__version__}",
                            hint="upgrade transformers or use a module: source")
    missing = missing_arch_fields(CONFIG_MAPPING[mt], data)
    if missing:
        raise MeshplanError(f"{str(src.path)!r}: the config does not define the architecture: missing "
                            f"{', '.join(missing)} (model_type {mt!r})",
                            hint="add them to the config (transformers would take its own defaults, a different model)")
    for what, names in ARCH_FIELDS[:5]:  # sizes that must be whole numbers >= 1 (a 0-layer model trains nothing)
        for n in names:
            v = data.get(n)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise MeshplanError(f"{str(src.path)!r}: {n} = {v!r} is not a whole number >= 1 (the model's {what})",
                                    hint=f"set {n} to the model's real {what}, as in its published config")
    kw = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    try:
        with quiet_transformers():
            return CONFIG_MAPPING[mt].from_dict(kw)
    except Exception as e:  # noqa: BLE001 - any config error becomes one line
        raise MeshplanError(f"{str(src.path)!r}: transformers rejects the config: {one_line(e)}",
                            hint="fix the field it names") from None


def missing_arch_fields(config_cls: type, data: dict[str, Any]) -> list[str]:
    """The architecture fields (ARCH_FIELDS) ``config_cls`` takes that ``data`` (a config.json)
    does not give, each by the family's own name."""
    import inspect

    try:
        params = inspect.signature(config_cls.__init__).parameters
    except (TypeError, ValueError):
        return []
    aliases = dict(getattr(config_cls, "attribute_map", {}) or {})  # canonical name -> the family's
    given = set(data) | {aliases[k] for k in data if k in aliases}
    missing = []
    for _, names in ARCH_FIELDS:
        taken = [n for n in names if n in params]
        if not taken or all(params[n].default is None for n in taken):
            continue  # the family has no such field, or derives it from the others
        if not any(n in given for n in taken):
            missing.append(taken[0])
    return missing


PADDING_OFFSET_TYPES = frozenset({"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm",
                                  "data2vec-text", "longformer"})
"""Families whose position ids start after the padding token (``pad_token_id + 1``): that many
rows of the position table are never a position."""


def usable_positions(config: Any, table: int) -> int:
    """Positions a sequence can use of a position table of ``table`` rows."""
    if getattr(config, "model_type", None) in PADDING_OFFSET_TYPES:
        pad = getattr(config, "pad_token_id", None)
        return table - (int(pad) + 1 if isinstance(pad, int) and pad >= 0 else 0)
    return table


def check_seq_len(config: Any, seq_len: int, path: str = "") -> None:
    """``seq_len`` against the config's maximum positions, where the model has a table of them
    (learned positions: GPT-2, BERT, RoBERTa, BART, OPT; precomputed tables: GPT-J): a longer
    sequence would index past it (on the meta device nothing would notice: the runtime would fail
    on the first batch). Rotary models that compute their angles per position (``rope_parameters``
    / ``rope_theta``) have no such limit."""
    if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None):
        return
    for key in _POSITION_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            usable = usable_positions(config, v)
            if seq_len > usable:
                where = f"{path!r}: " if path else ""
                key = (getattr(config, "attribute_map", None) or {}).get(key, key)  # GPT-2: n_positions
                of = (f"{key} = {v}, of which {v - usable} come before the first position "
                      f"(pad_token_id + 1)") if usable != v else key
                raise MeshplanError(f"{where}seq_len {seq_len} exceeds the model's {usable} positions ({of})",
                                    hint=f"use --seq-len <= {usable}, or a config with more positions "
                                         f"(a larger {key})")
            return


def pick_class(config: Any, path: str) -> tuple[type, str]:
    """(model class, task) for a config."""
    tf = _transformers()
    import transformers.models.auto.modeling_auto as ma

    task_of = {}
    for mapping, task in TASK_MAPPINGS:
        for cls_name in getattr(ma, mapping, {}).values():
            for name in (cls_name if isinstance(cls_name, (tuple, list)) else (cls_name,)):
                task_of.setdefault(name, task)
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(tf, arch, None) if isinstance(arch, str) else None
        if cls is not None and arch in task_of:
            return cls, task_of[arch]
    mt = config.model_type
    order = list(TASK_MAPPINGS)
    if getattr(config, "is_encoder_decoder", False):  # T5, BART: seq2seq first
        order.insert(0, order.pop(1))
    elif mt in getattr(ma, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", {}):  # encoders (BERT, RoBERTa): masked LM
        order.insert(0, order.pop(2))
    for mapping, task in order:
        name = getattr(ma, mapping, {}).get(mt)
        if isinstance(name, (tuple, list)):
            name = name[0]
        cls = getattr(tf, name, None) if name else None
        if cls is not None:
            return cls, task
    raise MeshplanError(f"{path!r}: no trainable head class for model_type {mt!r} "
                        "(causal LM, seq2seq LM, masked LM or classification)",
                        hint='set "architectures" to a transformers class name, or use a module: source')


def default_seq_len(config: Any, task: str) -> int:
    for key in _POSITION_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return min(usable_positions(config, v), MAX_DEFAULT_SEQ_LEN)
    return SEQ2SEQ_DEFAULT_SEQ_LEN if task == "seq2seq-lm" else DEFAULT_SEQ_LEN


def tf_version() -> str:
    return _transformers().__version__


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def _attn_impl(cls: type) -> str:
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def build_module(config: Any, cls: type, dtype: torch.dtype, device: str) -> nn.Module:
    """The model with random weights (the class's own init) on ``device``."""
    with quiet_transformers(), torch.device(device):
        dt = "dtype" if _major(tf_version()) >= 5 else "torch_dtype"  # transformers 4 calls it torch_dtype
        try:
            model = cls._from_config(config, attn_implementation=_attn_impl(cls), **{dt: dtype})
        except (ValueError, ImportError):  # the class refuses SDPA: its default attention
            model = cls._from_config(config, **{dt: dtype})
    model.train()
    return model


def vocab_size(config: Any) -> int:
    v = getattr(config, "vocab_size", None)
    if not isinstance(v, int) or v < 1:
        raise MeshplanError(f"config of model_type {config.model_type!r} has no vocab_size",
                            hint='add "vocab_size" to the config')
    return v


def make_batch_fn(config: Any, task: str, cls: type, seq_len: int, device: str, dtype: torch.dtype):
    """batch_size -> Batch of synthetic inputs and labels for the task (deterministic, seed 0)."""
    image = "pixel_values" in forward_params(cls)
    if not image:
        check_seq_len(config, seq_len)

    def make(batch_size: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        kw: dict[str, Any] = {}
        if image:
            c = int(getattr(config, "num_channels", 3))
            size = getattr(config, "image_size", 224)
            hw = tuple(size) if isinstance(size, (list, tuple)) else (int(size), int(size))
            kw["pixel_values"] = torch.randn(batch_size, c, *hw, generator=g).to(device=device, dtype=dtype)
            labels = torch.randint(0, int(getattr(config, "num_labels", 2)), (batch_size,), generator=g)
        else:
            def tokens() -> torch.Tensor:  # on the meta device: shapes only, no host memory for long sequences
                if str(device) == "meta":
                    return torch.empty((batch_size, seq_len), dtype=torch.long, device="meta")
                return torch.randint(0, vocab_size(config), (batch_size, seq_len), generator=g)
            ids = tokens()
            kw["input_ids"] = ids.to(device)
            if task == "seq2seq-lm":
                labels = tokens()
                start = getattr(config, "decoder_start_token_id", None) or 0
                dec = torch.cat([torch.full((batch_size, 1), int(start), device=labels.device), labels[:, :-1]], dim=1)
                kw["decoder_input_ids"] = dec.to(device)
            elif task == "classification":
                labels = torch.randint(0, int(getattr(config, "num_labels", 2)), (batch_size,), generator=g)
            else:
                labels = ids
        if "use_cache" in forward_params(cls):
            kw["use_cache"] = False
        return Batch(kwargs=kw, targets=labels.to(device))

    return make


def loss_for(task: str):
    """(outputs, batch) -> scalar loss in float32, from the logits (the model is given no labels)."""
    if task == "causal-lm":
        def loss(outputs: Any, batch: Batch) -> torch.Tensor:
            logits = class_logits(outputs)
            return token_ce(logits[:, :-1], batch.targets[:, 1:])
    elif task in ("seq2seq-lm", "masked-lm"):
        def loss(outputs: Any, batch: Batch) -> torch.Tensor:
            return token_ce(class_logits(outputs), batch.targets)
    else:
        def loss(outputs: Any, batch: Batch) -> torch.Tensor:
            return F.cross_entropy(class_logits(outputs).float(), batch.targets)
    return loss


def sample_tokens(config: Any, task: str, cls: type, seq_len: int) -> int:
    if "pixel_values" in forward_params(cls):
        size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
        if isinstance(size, int) and isinstance(patch, int) and patch > 0:
            return (size // patch) ** 2 + 1  # patches + the class token (ViT)
        return 1
    return 2 * seq_len if task == "seq2seq-lm" else seq_len


def check_patches(config: Any, source: str) -> None:
    """An image model's patches must fit in its images."""
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if isinstance(size, int) and isinstance(patch, int) and patch > size:
        raise MeshplanError(f"{source}: patch_size {patch} is larger than image_size {size}: no patch fits",
                            hint="use a patch_size that divides image_size")


def check_image_tokens(config: Any, cls: type, seq_len: int | None, source: str) -> None:
    """An image model's tokens come from its config (image_size, patch_size): a ``seq_len`` other
    than them, or patches larger than the image, do not suit it."""
    check_patches(config, source)
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    tokens = sample_tokens(config, "classification", cls, 1)
    if seq_len is not None and seq_len != tokens:
        what = (f"{size}x{size} images in {patch}x{patch} patches: {tokens} tokens per image (patches + the "
                f"class token)" if tokens > 1 else "whole images, not token sequences")
        raise MeshplanError(f"{source}: --seq-len {seq_len} does not suit {cls.__name__}: it takes {what}",
                            hint="drop --seq-len (the config's image_size and patch_size set the tokens), or "
                                 "change them in the config")


def head_counts(config: Any) -> tuple[int | None, int | None]:
    """(attention heads, key/value heads) from the config, None when not given."""
    heads = next((getattr(config, k) for k in ("num_attention_heads", "n_head", "num_heads", "n_heads")
                  if isinstance(getattr(config, k, None), int)), None)
    kv = next((getattr(config, k) for k in ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
               if isinstance(getattr(config, k, None), int)), None)
    if kv is None and getattr(config, "multi_query", False):
        kv = 1
    return heads, kv or heads


def forward_params(cls: type) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return set()


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
