"""Pipeline stages of a Hugging Face decoder-only causal LM or encoder, without tracing.

torch.fx cannot trace transformers' causal LMs (the masking code branches on shapes, the
forwards take `**kwargs`), so each stage is a *shell* of the model: the same classes and
forward code, with its own copy of the module tree down to the decoder-layer list, in which
the layers of other stages are parameter-free pass-throughs. Parameter names stay those of
the full model, so checkpoints reshard between plans with and without PP, and TP styles,
recompute and FSDP find their modules by the plan's paths.
  stage 0        embeds the token ids (`input_ids`);
  later stages   receive the hidden states as `inputs_embeds` (their embedding is removed);
                 what the base model does to the embeddings before its first block (GPT-2's
                 learned positions, an embedding dropout, Granite's embedding multiplier,
                 OPT's input projection)
                 is left out there: positions add a zero, dropouts pass through, the
                 multiplier is 1;
  every stage    builds the rotary cos/sin from `position_ids` (this rank's positions; a
                 family without positions, Mamba, ignores them);
  an encoder     (BERT) whose embedding module is a stem the base model always calls (it adds
                 positions and token types and normalises): on later stages the stem hands
                 its `inputs_embeds` on as they are;
  last stage     applies the final norm (and an output projection, OPT's) and the head
                 through the causal LM's forward;
                 other stages run the base model alone, with the final norm a `StageGap`,
                 so their output is the hidden states.
The module names differ by family (_FAMILIES); the families verified are SPLIT_MODEL_TYPES
(each by tests/runtime/test_pipeline_hf.py: its stages chained in one process give the whole
model's logits; the first of them also by a pp2 parity case in tests/runtime/test_parity.py),
others are refused with a reason.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from autoplan.models.hf import special_floats_read_back


@dataclass(frozen=True)
class _Parts:
    """Module names of a family: in the base model, the token embedding, the block list (a
    dotted path), the final norm ("" for none) and the input-side modules only the first stage
    applies; the causal LM's (or masked LM's) head."""
    embed: str = "embed_tokens"
    layers: str = "layers"
    norm: str = "norm"
    stem: bool = False  # the base model calls `embed` even when given inputs_embeds
    head: str = "lm_head"
    first_stage_only: tuple[str, ...] = ()
    # float attributes of the base model that act on `inputs_embeds` before the first block,
    # with the value that makes them a no-op on a later stage, whose input has had them
    # (Granite's embedding_multiplier, Starcoder2's embedding_dropout)
    later_stage_values: tuple[tuple[str, float], ...] = ()
    layer_tuple: bool = False  # the base model reads a layer's output as `outputs[0]` (Falcon)
    # the base model's module that holds the parts above, "" for the base model itself (OPT's
    # `decoder`)
    decoder: str = ""
    # output-side modules only the last stage applies, after the final norm (OPT's project_out)
    last_stage_only: tuple[str, ...] = ()
    # parts a config may leave None (OPT's projections where word_embed_proj_dim = hidden_size,
    # its final norm where do_layer_norm_before is false)
    optional: tuple[str, ...] = ()


_FAMILIES = {
    "gemma": _Parts(), "gemma2": _Parts(), "gemma3_text": _Parts(), "llama": _Parts(),
    "mistral": _Parts(), "mixtral": _Parts(), "olmo2": _Parts(), "phi3": _Parts(), "qwen2": _Parts(),
    "qwen2_moe": _Parts(), "qwen3": _Parts(),
    "mamba": _Parts(embed="embeddings", norm="norm_f"),
    "gpt2": _Parts(embed="wte", layers="h", norm="ln_f", first_stage_only=("wpe", "drop")),
    "gpt_neox": _Parts(embed="embed_in", norm="final_layer_norm", first_stage_only=("emb_dropout",)),
    "gptj": _Parts(embed="wte", layers="h", norm="ln_f", first_stage_only=("drop",)),
    "granite": _Parts(later_stage_values=(("embedding_multiplier", 1.0),)),
    "granitemoe": _Parts(later_stage_values=(("embedding_multiplier", 1.0),)),
    "cohere": _Parts(), "glm": _Parts(), "stablelm": _Parts(),
    "starcoder2": _Parts(later_stage_values=(("embedding_dropout", 0.0),)),
    "falcon": _Parts(embed="word_embeddings", layers="h", norm="ln_f", layer_tuple=True),
    # ALiBi: every stage builds the bias from its hidden states' length, as the whole model
    "bloom": _Parts(embed="word_embeddings", layers="h", norm="ln_f", layer_tuple=True,
                    first_stage_only=("word_embeddings_layernorm",)),
    "mpt": _Parts(embed="wte", layers="blocks", norm="norm_f", layer_tuple=True),
    "deepseek_v3": _Parts(),
    "opt": _Parts(decoder="decoder", norm="final_layer_norm", first_stage_only=("embed_positions", "project_in"),
                  last_stage_only=("project_out",), optional=("final_layer_norm", "project_in", "project_out")),
    "bert": _Parts(embed="embeddings", layers="encoder.layer", norm="", head="cls", stem=True),
    # the base model scales the embeddings by its `normalizer` buffer before the first block
    "recurrent_gemma": _Parts(norm="final_norm", later_stage_values=(("normalizer", 1.0),)),
}
SPLIT_MODEL_TYPES = tuple(sorted(_FAMILIES))


class StageGap(nn.Identity):
    """Where a pipeline stage leaves out a module of the model (norm or head of an earlier
    stage): passes its input through and holds no parameters; parallelisms skip it."""


class _OtherStageLayer(nn.Module):
    """A decoder layer held by another stage: returns the hidden states unchanged, as the
    family's layers return them (alone, or first in a tuple). It keeps the layer's plain
    attributes (strings, numbers), which a base model's loop may read off each layer to pick
    its mask (Nemotron-H's `block_type`)."""

    def __init__(self, in_tuple: bool, layer: nn.Module) -> None:
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_") and isinstance(value, (str, int, float, bool)) and name != "training":
                setattr(self, name, value)
        self.in_tuple = in_tuple

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.in_tuple else hidden_states


class _PassEmbeddings(StageGap):
    """An encoder's embedding stem on a stage after the first: its `inputs_embeds` are the
    hidden states the previous stage handed on, already embedded and normalised."""

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return inputs_embeds


class _NoPositions(StageGap):
    """A learned position embedding on a stage after the first, whose input already holds
    them: adds a zero (0-dim, so the hidden states keep their dtype). A gap, so that a style
    the plan gives the embedding (a vocab_embedding where the positions number the
    vocabulary) is not applied to it."""

    def forward(self, positions: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # the position ids (GPT-2) or, first, the attention mask they come from (OPT)
        return torch.zeros((), device=positions.device)


def hf_split_problem(model: nn.Module) -> str | None:
    """None when `split_hf_stages` can split this model, else the reason it cannot.

    A family outside SPLIT_MODEL_TYPES with the common layout (`embed_tokens`, `layers`,
    `norm`, `lm_head`) is split when a tiny copy of its config passes the check the verified
    families pass in the tests (`tiny_copy_problem`)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        return "it is not a Hugging Face model"
    problem = _layout_problem(model, _named_parts(model))
    if model_type in SPLIT_MODEL_TYPES:
        return problem
    if problem is None:
        config_json, layers = config.to_json_string(), tiny_layers(model)
        layer_tuple = _layers_in_tuple(type(model), config_json, *layers)
        problem = tiny_copy_problem(type(model), config_json, layer_tuple, *layers)
    if problem is not None:
        return (f"the pipeline split of Hugging Face models is verified for "
                f"{', '.join(SPLIT_MODEL_TYPES)}, and for other families of their layout "
                f"(embed_tokens / layers / norm / lm_head) by a tiny copy of the config; "
                f"{model_type!r}: {problem}")
    return None


def _layout_problem(model: nn.Module, parts: _Parts) -> str | None:
    base = _decoder(getattr(model, base_model_name(model), None), parts)
    names = tuple(n for n in (parts.embed, parts.layers, parts.norm, *parts.first_stage_only,
                              *parts.last_stage_only) if n)
    if base is None or not all(_get(base, n) is not None or n in parts.optional for n in names) \
            or not hasattr(model, parts.head):
        return f"it lacks the {' / '.join(names)} / {parts.head} modules the split expects"
    return None


def base_model_name(model: nn.Module) -> str:
    """The attribute of a Hugging Face model that holds its base model: its class's
    `base_model_prefix`, or `model` where the class names a prefix it does not hold
    (Llama4ForCausalLM says "language_model", the name in its multimodal checkpoints, and
    keeps its decoder at `.model`)."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    return "model" if isinstance(getattr(model, "model", None), nn.Module) else prefix


def _parts(model: nn.Module) -> _Parts:
    """A verified family's parts; else the common layout's names (`_named_parts`), its layers'
    output alone or first in a tuple, whichever its tiny copy checks out with."""
    parts = _named_parts(model)
    if model.config.model_type in _FAMILIES:
        return parts
    return replace(parts, layer_tuple=_layers_in_tuple(type(model), model.config.to_json_string(),
                                                       *tiny_layers(model)))


def _named_parts(model: nn.Module) -> _Parts:
    """A verified family's parts; else the common layout, with the token embedding and the
    final norm under the first of the names families give them that the base model holds
    (the tiny copy checks the guess)."""
    if model.config.model_type in _FAMILIES:
        return _FAMILIES[model.config.model_type]
    base = getattr(model, base_model_name(model), None)

    def held(names: tuple[str, ...]) -> str:
        return next((n for n in names if isinstance(getattr(base, n, None), nn.Module)), names[0])

    return _Parts(embed=held(_EMBEDDINGS), norm=held(_FINAL_NORMS))


@functools.lru_cache(maxsize=None)
def _layers_in_tuple(model_class: type, config_json: str, layers: int, kinds: int) -> bool:
    """Whether the base model reads each layer's output as `outputs[0]` (Falcon-H1): its tiny
    copy fails with layers held by other stages returning the hidden states alone, and checks
    out with them returning a tuple."""
    return (tiny_copy_problem(model_class, config_json, False, layers, kinds) is not None
            and tiny_copy_problem(model_class, config_json, True, layers, kinds) is None)


def layer_kind(layer: nn.Module) -> tuple[tuple[str, str], ...]:
    """What a layer is built of: its modules' names and classes (Jamba's Mamba and attention
    layers, Llama-4's dense and routed feed-forwards in one layer class)."""
    return tuple((name, type(module).__name__) for name, module in layer.named_modules())


def _per_layer_fields(config) -> list[tuple]:
    """Each layer's values of the config's per-layer lists (layer_types, no_rope_layers)."""
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int):
        return []
    lists = [v for v in vars(config).values() if isinstance(v, list) and len(v) == count]
    return [tuple(str(values[i]) for values in lists) for i in range(count)]


def tiny_layers(model: nn.Module) -> tuple[int, int]:
    """How many leading layers a tiny copy keeps to hold a layer of every kind the model has
    (built of other modules, or given other per-layer config values; at least two, at most
    _MAX_TINY_LAYERS), and how many kinds of modules the model's layers are built of."""
    layers = _layers_of(model)
    fields = _per_layer_fields(model.config)
    first_of_kind: dict[tuple, int] = {}
    for index, layer in enumerate(layers):
        first_of_kind.setdefault((layer_kind(layer), fields[index] if index < len(fields) else ()), index)
    needed = max(first_of_kind.values(), default=0) + 1
    return (min(max(_TINY_LAYERS, needed), _MAX_TINY_LAYERS),
            len({layer_kind(layer) for layer in layers}))


# names of the common layout's parts in other families: Nemotron-H's embeddings and norm_f,
# Jamba's final_layernorm, RecurrentGemma's final_norm, and LFM2's final norm (named for the
# embedding, applied after the last block)
_EMBEDDINGS = ("embed_tokens", "embeddings")
_FINAL_NORMS = ("norm", "final_layernorm", "final_norm", "norm_f", "embedding_norm")


# a tiny copy's sizes, where its config has the field (the rest keep the model's values)
_TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16,
               "vocab_size": 256, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
               "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok")
_TINY_LAYERS, _MAX_TINY_LAYERS, _TINY_TOKENS, _TINY_MAX_PARAMETERS = 2, 16, 8, 160_000_000


@functools.lru_cache(maxsize=None)
def tiny_copy_problem(model_class: type, config_json: str, layer_tuple: bool = False,
                      layers: int = _TINY_LAYERS, kinds: int = 1) -> str | None:
    """None when a copy of the model at tiny sizes (its first `layers` layers, as many as hold
    a layer of every kind the model has: `tiny_layers`, which also counts the `kinds` of
    modules its layers are built of; the config's other fields kept),
    its dropouts at 0.1, split into one stage per layer (the common layout's parts,
    layers held elsewhere returning a tuple where `layer_tuple`) and chained in one process in
    training mode from one seed, gives the whole copy's logits: a module applied on two stages
    or on none (an embedding scale, a dropout drawing twice) moves them by far more than
    rounding. Else what failed.

    A copy that fails to build or run at the tiny sizes is made again with the model's own head
    size and expert counts (`shrink_config`'s keep_structure): a config that states other sizes
    in their terms (MLA's rotary and latent dimensions per head, a rotary_dim, grouped routing's
    expert groups) is only consistent with the ones it came with."""
    problem = _tiny_copy_problem(model_class, config_json, layer_tuple, layers, kinds, False)
    if problem is not None and problem.startswith(_FAILED):
        problem = _tiny_copy_problem(model_class, config_json, layer_tuple, layers, kinds, True)
    return problem


_FAILED = "its tiny copy failed"


def _tiny_copy_problem(model_class: type, config_json: str, layer_tuple: bool, layers: int,
                       kinds: int, keep_structure: bool) -> str | None:
    config = model_class.config_class.from_dict(special_floats_read_back(json.loads(config_json)))
    try:
        shrink_config(config, layers, keep_structure)
        with torch.device("meta"):
            shape = model_class(config)
        size = sum(p.numel() for p in shape.parameters())
        if size > _TINY_MAX_PARAMETERS:
            return f"its tiny copy keeps {size:,} parameters (a size field autoplan does not shrink)"
        if len({layer_kind(layer) for layer in _layers_of(shape)}) < kinds:
            return (f"its tiny copy's first {layers} layers lack a kind of layer the model has "
                    f"(the model brings one in after its first {_MAX_TINY_LAYERS} layers)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = model_class(config).float().train()
            ids = torch.randint(0, config.vocab_size, (1, _TINY_TOKENS))
            positions = torch.arange(_TINY_TOKENS)
            with torch.no_grad():
                torch.manual_seed(1)
                whole = model(input_ids=ids, position_ids=positions[None], use_cache=False).logits
                torch.manual_seed(1)
                x = ids
                parts = replace(_named_parts(model), layer_tuple=layer_tuple)
                for shell in split_hf_stages(model, [[p] for p in hf_block_paths(model)], positions, False, parts):
                    x = shell(x)
    except Exception as exc:  # a config the shrinking breaks, or a forward the shells cannot run
        return f"{_FAILED} ({type(exc).__name__}: {str(exc)[:200]})"
    if x.shape != whole.shape or not torch.allclose(x, whole, rtol=1e-6, atol=1e-6):
        return "its tiny copy gives other logits chained stage by stage than whole"
    return None


def shrink_config(config, layers: int = _TINY_LAYERS, keep_structure: bool = False) -> None:
    """`config` at tiny sizes, in place: fields that count per layer cut to `layers` layers.
    With `keep_structure`, only widths and the head count are cut: the tiny heads keep the
    model's head size (the hidden size is the tiny head count times it, head_dim untouched),
    and the model keeps its experts and experts per token (each of them tiny)."""
    model_layers = config.num_hidden_layers
    sizes = dict(_TINY_SIZES)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if keep_structure:
        for name in _EXPERT_COUNTS:
            del sizes[name]
        if isinstance(heads, int) and isinstance(config.hidden_size, int):
            head_size = getattr(config, "head_dim", None)
            head_size = head_size if isinstance(head_size, int) else config.hidden_size // heads
            del sizes["head_dim"]
            sizes["hidden_size"] = sizes["num_attention_heads"] * head_size
    for name, value in sizes.items():
        # a size some configs derive (Falcon's head_dim: a property of hidden size and heads)
        declared = getattr(type(config), name, None)
        derived = isinstance(declared, property) and declared.fset is None
        if isinstance(getattr(config, name, None), int) and not derived:
            setattr(config, name, value)
    if isinstance(kv_heads, int):  # one K/V head, one per head (MLA reads them so), or grouped
        config.num_key_value_heads = 1 if kv_heads == 1 else config.num_attention_heads if kv_heads == heads else 2
    for name, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == model_layers:
            setattr(config, name, value[:layers])
        elif "dropout" in name and isinstance(value, float):
            setattr(config, name, 0.1)
        elif name.endswith("token_id") and isinstance(value, int) and value >= config.vocab_size:
            setattr(config, name, 0)
    config.num_hidden_layers = layers
    config.use_cache = False


def _decoder(base: nn.Module | None, parts: _Parts) -> nn.Module | None:
    """The module of the base model that holds the family's parts."""
    return _get(base, parts.decoder) if base is not None and parts.decoder else base


def hf_block_paths(model: nn.Module) -> list[str]:
    """The full paths of the decoder blocks of a model `hf_split_problem` accepts."""
    parts = _named_parts(model)
    prefix = ".".join(n for n in (base_model_name(model), parts.decoder, parts.layers) if n)
    return [f"{prefix}.{i}" for i in range(len(_get(model, prefix)))]


def _layers_of(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a model `hf_split_problem` accepts (`hf_block_paths`)."""
    return [_get(model, path) for path in hf_block_paths(model)]


def _get(module: nn.Module, dotted: str) -> nn.Module | None:
    for name in dotted.split("."):
        module = getattr(module, name, None)
    return module


def _no_op_value(value, no_op: float):
    """`no_op` in the form of the base model's `value`: a float, or a buffer of its shape and
    dtype (RecurrentGemma's `normalizer`, never saved: a stage's own copy does not reach a
    checkpoint)."""
    return torch.full_like(value, no_op) if isinstance(value, torch.Tensor) else no_op


def _with_child(module: nn.Module, dotted: str, child: nn.Module) -> dict[str, nn.Module]:
    """The children of `module` that put `child` at the dotted path, the modules on the way
    shelled (their other children shared)."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return {head: child}
    inner = getattr(module, head)
    return {head: _shell(inner, _with_child(inner, rest, child))}


def _shell(module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
    """A copy of `module` sharing its parameters, buffers and code, with its own module,
    hook and parameter dicts (so one stage's wrappers never reach another stage)."""
    copy = module.__class__.__new__(module.__class__)
    copy.__dict__ = {k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()}
    copy._modules.update(children)
    return copy


def _stage_forward(root: nn.Module, prefix: str, first: bool, last: bool, positions: torch.Tensor,
                   zigzag: bool):
    """forward(x) of a stage: token ids (first stage) or hidden states -> logits (last stage,
    through the causal LM's own forward) or hidden states (the base model's forward alone:
    what a causal LM does after its base model, such as Mamba's cast to the head's dtype or
    a logit soft-cap, belongs to the last stage only)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids" if first else "inputs_embeds": x,
                  "position_ids": positions.to(x.device)[None, :], "use_cache": False}
        if zigzag:  # zig-zag CP positions jump, yet are one sequence, not packed ones
            kwargs["attention_mask"] = torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
        if last:
            return type(root).forward(root, **kwargs).logits
        return getattr(root, prefix)(**kwargs).last_hidden_state

    return forward


def split_hf_stages(model: nn.Module, stages: list[list[str]], positions: torch.Tensor,
                    zigzag: bool, parts: _Parts | None = None) -> list[nn.Module]:
    """One shell per (virtual) stage, holding the decoder layers the plan gives it.
    `zigzag`: the positions are a context-parallel rank's (flag, not read from the tensor,
    so the split also runs on fake tensors). `parts`: the family's (`_parts`) unless given."""
    parts = parts or _parts(model)
    prefix = base_model_name(model)
    base = getattr(model, prefix)
    decoder = _decoder(base, parts)
    blocks = _get(decoder, parts.layers)
    layer_paths = hf_block_paths(model)
    shells = []
    for k, paths in enumerate(stages):
        first, last = k == 0, k == len(stages) - 1
        layers = nn.ModuleList(layer if path in paths else _OtherStageLayer(parts.layer_tuple, layer)
                               for layer, path in zip(blocks, layer_paths))
        later_embed = _PassEmbeddings() if parts.stem else None
        children = {**_with_child(decoder, parts.layers, layers),
                    parts.embed: getattr(decoder, parts.embed) if first else later_embed}
        ends = [(name, first) for name in parts.first_stage_only]
        ends += [(name, last) for name in (parts.norm, *parts.last_stage_only) if name]
        for name, kept in ends:
            module = getattr(decoder, name)
            if module is None or kept:
                children[name] = module
            else:
                children[name] = _NoPositions() if isinstance(module, nn.Embedding) else StageGap()
        stage_decoder = _shell(decoder, children)
        for name, no_op in parts.later_stage_values if not first else ():
            setattr(stage_decoder, name, _no_op_value(getattr(decoder, name), no_op))
        stage_base = _shell(base, _with_child(base, parts.decoder, stage_decoder)) if parts.decoder else stage_decoder
        root = _shell(model, {prefix: stage_base,
                              parts.head: getattr(model, parts.head) if last else StageGap()})
        root.forward = _stage_forward(root, prefix, first, last, positions, zigzag)
        shells.append(root)
    return shells
