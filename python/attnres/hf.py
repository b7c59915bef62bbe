"""Convert a Hugging Face decoder to Attention Residuals in place, exactly.

    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    attnres.hf.convert(model, block_size=None)        # or S: Block AttnRes

Every sublayer (attention, MLP) of every decoder layer gets its own
:class:`attnres.AttnResResidual` read (zero query, unit gain), and the network's
output one more, read before the final norm. A PreNorm layer computes
``x + f(norm(x))``; converted, its sublayer reads the mean of the sources,
``x / N`` at zero queries (the sources sum to the residual stream x), so each
pre-norm's epsilon becomes ``eps / N**2`` and ``norm(x / N)`` equals ``norm(x)``
exactly: the converted model computes the original function, and continued
training starts from the pretrained model.

A family is one entry of ``FAMILIES`` (its decoder layer's attribute names),
never a copy of its forward. Families whose sublayers do not read a pre-norm
of the residual stream are refused (``REFUSED``), never approximated.
Requires ``transformers`` (``pip install "attnres[hf]"``).
"""
from __future__ import annotations

import functools
import inspect
from typing import Dict, NamedTuple, Optional

import torch
from torch import nn

from .modules import AttnResResidual, DepthStream


class Family(NamedTuple):
    """Where a PreNorm decoder layer keeps its parts: attribute names (None:
    the layer has no such part)."""

    pre_attn_norm: str
    attn: str
    post_attn_norm: Optional[str]  # a norm of the sublayer's output (Gemma 2/3): part of f
    pre_mlp_norm: str
    mlp: str
    post_mlp_norm: Optional[str]
    eps: str  # the norms' epsilon attribute
    layers: str  # the decoder layers, on the base model
    final_norm: str  # the final norm, on the base model
    rmsnorm: bool = False  # its norms are weight * RMSNorm(x): out_norm="rmsnorm" can fuse them


_LLAMA = Family("input_layernorm", "self_attn", None, "post_attention_layernorm", "mlp", None,
                "variance_epsilon", "layers", "norm", rmsnorm=True)
_GEMMA2 = Family("input_layernorm", "self_attn", "post_attention_layernorm",
                 "pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm", "eps", "layers",
                 "norm")

# Decoder layer class name -> its family entry.
FAMILIES: Dict[str, Family] = {
    "LlamaDecoderLayer": _LLAMA,
    "MistralDecoderLayer": _LLAMA,
    "Qwen2DecoderLayer": _LLAMA,
    "Qwen3DecoderLayer": _LLAMA,
    "GemmaDecoderLayer": _LLAMA._replace(eps="eps", rmsnorm=False),  # (1 + w) * RMSNorm(x)
    "Gemma2DecoderLayer": _GEMMA2,
    "Gemma3DecoderLayer": _GEMMA2,
    "GPT2Block": Family("ln_1", "attn", None, "ln_2", "mlp", None, "eps", "h", "ln_f"),
}

# Arguments of a layer's forward that its attention does not take: cross
# attention, which a decoder-only conversion does not support.
_CROSS_ATTENTION = ("encoder_hidden_states", "encoder_attention_mask")

# Layer class name -> why its model cannot be converted exactly.
REFUSED: Dict[str, str] = {
    "GPTJBlock": "attention and MLP run in parallel on one norm of the residual stream",
    "FalconDecoderLayer": "attention and MLP run in parallel on the residual stream",
    "PhiDecoderLayer": "attention and MLP run in parallel on one norm of the residual stream",
    "Olmo2DecoderLayer": "its norms are applied to the sublayer outputs, not to the residual stream",
}


def _sources_read_by(j: int, block_size: Optional[int]) -> int:
    """How many sources read j (after j outputs) sees."""
    if block_size is None:
        return j + 1
    return 1 + j // block_size + (1 if j % block_size else 0)


def _attention_kwargs(layer, hidden_states, args, kwargs) -> dict:
    """The layer's call arguments after hidden_states, by name (the model
    may pass some positionally), as its attention takes them."""
    signature = _SIGNATURES[type(layer)]
    bound = signature.bind(layer, hidden_states, *args, **kwargs).arguments
    out = {}
    for name, value in bound.items():
        if name in ("self", "hidden_states"):
            continue
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif name in _CROSS_ATTENTION:
            if value is not None:
                raise ValueError(f"a converted decoder layer does not take {name} (cross attention)")
        else:
            out[name] = value
    return out


def _converted_forward(self, hidden_states, *args, **kwargs):
    """A converted decoder layer: takes the stream (the first layer: the
    embeddings) and returns a new one with its two outputs appended."""
    fam: Family = self.attnres_family
    attn_kwargs = _attention_kwargs(self, hidden_states, args, kwargs)
    stream = hidden_states
    if not isinstance(stream, DepthStream):
        stream = DepthStream(hidden_states, self.attnres_block_size, readers=self.attnres_readers)
    stream = stream.clone()
    h = getattr(self, fam.pre_attn_norm)(self.attnres_attn(stream))
    out = getattr(self, fam.attn)(hidden_states=h, **attn_kwargs)
    out = out[0] if isinstance(out, tuple) else out
    stream.append(getattr(self, fam.post_attn_norm)(out) if fam.post_attn_norm else out)
    out = getattr(self, fam.mlp)(getattr(self, fam.pre_mlp_norm)(self.attnres_mlp(stream)))
    stream.append(getattr(self, fam.post_mlp_norm)(out) if fam.post_mlp_norm else out)
    return stream


_CONVERTED_CLASSES: Dict[type, type] = {}
_SIGNATURES: Dict[type, inspect.Signature] = {}  # converted class -> the original forward's


def _converted_class(cls: type) -> type:
    """``cls`` with the stream forward: a subclass, so that what the class
    does around its forward (transformers' gradient checkpointing wraps
    each layer class's forward) applies to the new one. Its instances
    pickle and deepcopy through the original class (the subclass is made
    at run time, so pickle cannot find it by name)."""
    if cls not in _CONVERTED_CLASSES:
        new = type(f"AttnRes{cls.__name__}", (cls,),
                   {"forward": _converted_forward, "__module__": __name__,
                    "__reduce_ex__": _reduce_converted})
        _CONVERTED_CLASSES[cls] = new
        _SIGNATURES[new] = inspect.signature(cls.forward)
    return _CONVERTED_CLASSES[cls]


def _reduce_converted(self, protocol):
    return _new_converted, (type(self).__bases__[0],), self.__dict__.copy()


def _new_converted(cls: type) -> nn.Module:
    converted = _converted_class(cls)
    return converted.__new__(converted)


def _final_read(read: AttnResResidual, _module, args):
    """The final norm's pre-hook: the norm reads the stream's final read."""
    return (read(args[0]),)


def _as_residual(value):
    """A stream as the tensor the original model's API promises there, the
    sum of its sources (the residual stream); other values as they are."""
    if isinstance(value, DepthStream):
        sources = value.sources
        total = sources[0]
        for t in sources[1:]:
            total = total + t
        return total
    if isinstance(value, (tuple, list)):
        return type(value)(_as_residual(v) for v in value)
    return value


def _residual_hidden_states(module, args, kwargs, output):
    """output_hidden_states: each layer's stream as a tensor (a ModelOutput's
    hidden_states, or anywhere in a return_dict=False tuple)."""
    if isinstance(output, tuple):
        return _as_residual(output)
    states = getattr(output, "hidden_states", None)
    if states:
        output.hidden_states = _as_residual(states)
    return output


def _base_model(model: nn.Module) -> nn.Module:
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


def convert(model: nn.Module, *, block_size: Optional[int] = None,
            block_layers: Optional[int] = None, out_norm: Optional[str] = None,
            dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Converts ``model`` (a transformers decoder, or its base model) in place
    and returns it. ``block_size``: None for Full AttnRes, S sublayers per
    block for Block AttnRes; or ``block_layers``: S layers per block (Kimi
    K3's convention; a layer has 2 sublayers). ``out_norm="rmsnorm"``: each
    pre-norm (and the final norm) is fused into its read, its gain becoming
    the read's ``out_weight`` (families whose norms are ``weight *
    RMSNorm(x)``). ``dtype``: the reads' parameters (default: the model's)."""
    if block_layers is not None:
        if block_size is not None:
            raise ValueError("attnres.hf.convert: give block_size (sublayers) or block_layers, not both")
        if isinstance(block_layers, bool) or not isinstance(block_layers, int) or block_layers <= 0:
            raise ValueError(f"block_layers must be a positive int, got {block_layers!r}")
        block_size = 2 * block_layers
    DepthStream(torch.zeros(1, 1), block_size)  # the stream's own check of block_size
    if out_norm not in (None, "rmsnorm"):
        raise ValueError(f"out_norm must be None or 'rmsnorm', got {out_norm!r}")
    base = _base_model(model)
    if getattr(base, "attnres_final", None) is not None:
        raise ValueError("attnres.hf.convert: the model is already converted")
    candidates = [m for m in base.modules() if type(m).__name__ in REFUSED]
    if candidates:
        kind = type(candidates[0]).__name__
        raise ValueError(f"attnres.hf.convert cannot convert {kind} exactly: {REFUSED[kind]}; "
                         "AttnRes replaces the residual input of PreNorm sublayers")
    found = [m for m in base.modules() if type(m).__name__ in FAMILIES]
    if not found:
        raise ValueError(
            f"attnres.hf.convert: no decoder layer of a known PreNorm family in "
            f"{type(model).__name__} (known: {', '.join(sorted(FAMILIES))}); a family is one "
            "entry of attnres.hf.FAMILIES"
        )
    kind = type(found[0]).__name__
    fam = FAMILIES[kind]
    if out_norm and not fam.rmsnorm:
        raise ValueError(f"out_norm='rmsnorm' fuses norms of the form weight * RMSNorm(x); "
                         f"{kind}'s are not: convert it with out_norm=None")
    layers = getattr(base, fam.layers, None)
    if layers is None or not hasattr(base, fam.final_norm):
        raise ValueError(
            f"attnres.hf.convert: {type(model).__name__} holds {kind} layers but not as "
            f"{type(base).__name__}.{fam.layers} with a final norm .{fam.final_norm}: convert the "
            "decoder that holds them (a multimodal model's language model)")
    width = getattr(layers[0], fam.pre_attn_norm).weight.shape[-1]
    if out_norm and dtype is not None:
        raise ValueError("attnres.hf.convert: with out_norm='rmsnorm' the reads take their norm "
                         "gains' dtype; leave dtype=None")

    def make_read(owner: nn.Module, norm_name: str, j: int) -> AttnResResidual:
        """Read j (after j outputs), and its norm's eps made eps / N**2."""
        norm = getattr(owner, norm_name)
        eps = getattr(norm, fam.eps) / _sources_read_by(j, block_size) ** 2
        if out_norm is None:
            setattr(norm, fam.eps, eps)  # on the norm's device, in its dtype unless given
            return AttnResResidual(width, dtype=dtype or norm.weight.dtype, device=norm.weight.device)
        read = AttnResResidual(width, out_norm="rmsnorm", out_eps=eps, dtype=norm.weight.dtype,
                               device=norm.weight.device)
        read.out_weight = norm.weight  # the same Parameter: the gain moves into the read
        setattr(owner, norm_name, nn.Identity())
        return read

    originals = {type(layer) for layer in layers}
    readers = []
    for j, layer in enumerate(layers):
        layer.attnres_attn = make_read(layer, fam.pre_attn_norm, 2 * j)
        layer.attnres_mlp = make_read(layer, fam.pre_mlp_norm, 2 * j + 1)
        readers += [layer.attnres_attn, layer.attnres_mlp]
    base.attnres_final = make_read(base, fam.final_norm, 2 * len(layers))
    readers.append(base.attnres_final)
    for layer in layers:
        # Plain attributes: the family and the reads' order are not submodules.
        object.__setattr__(layer, "attnres_family", fam)
        object.__setattr__(layer, "attnres_block_size", block_size)
        object.__setattr__(layer, "attnres_readers", tuple(readers) if block_size else None)
        layer.__class__ = _converted_class(type(layer))
    getattr(base, fam.final_norm).register_forward_pre_hook(
        functools.partial(_final_read, base.attnres_final))
    # Device maps and FSDP auto-wrapping find the layers by class name.
    for m in {id(model): model, id(base): base}.values():
        names = getattr(m, "_no_split_modules", None)
        if names:
            added = [_converted_class(c).__name__ for c in originals if c.__name__ in names]
            m._no_split_modules = type(names)([*names, *added])
    base.register_forward_hook(_residual_hidden_states, with_kwargs=True)
    base.config.attnres = {"block_size": block_size, "out_norm": out_norm}
    return model


def from_pretrained(path, **kwargs) -> nn.Module:
    """Loads a converted model saved with ``save_pretrained``: the original
    architecture through ``transformers.AutoModelForCausalLM`` (``kwargs``
    go to it), converted with the saved settings (``config.attnres``), then
    the reads' parameters from the saved weights."""
    import json
    import os

    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(path)
    settings = getattr(config, "attnres", None)
    if not isinstance(settings, dict):
        raise ValueError(f"attnres.hf.from_pretrained: {path} holds no converted model "
                         "(its config has no 'attnres' settings); load it with transformers")
    files = ["model.safetensors"]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    state = {}
    for name in files:
        state.update({k: v for k, v in load_file(os.path.join(path, name)).items() if ".attnres_" in k})
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the reads' weights are unknown to transformers
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
    # The reads follow the loaded model's dtype; load_state_dict casts the saved ones.
    convert(model, block_size=settings["block_size"], out_norm=settings.get("out_norm"))
    missing = [k for k in model.state_dict() if ".attnres_" in k and k not in state]
    if missing:
        raise ValueError(f"attnres.hf.from_pretrained: {path} lacks the reads' weights {missing[:3]}")
    model.load_state_dict(state, strict=False)
    return model
