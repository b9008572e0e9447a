"""Tiny random configurations of transformers model types, found at run time (no download, no list).

:func:`moe_model_types` lists the installed transformers' text model types whose modeling code mentions
experts (a cheap text filter: importing every model module would take minutes); which of them really
contain an MoE block is decided on the built model. :func:`tiny_config` shrinks a type's default config
by the names of its size fields: 32 hidden, 8 experts, top-2, 2-4 layers chosen so that every distinct
layer kind of the default config (attention kind, dense / MoE MLP) appears once.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

NUM_EXPERTS, HIDDEN, FFN, HEAD_DIM, VOCAB = 8, 32, 12, 8, 64
_TOPK = re.compile(r"(num_experts_per_tok|num_experts_per_token|moe_topk|moe_top_k|top_k|top_k_experts|moe_k)$")


def moe_model_types() -> list[tuple[str, str]]:
    """``(model_type, model class name)`` of every text model type that may hold MoE blocks: causal LMs,
    then text-only base models (the text towers of multimodal MoE models, seq2seq MoE models)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    root = pathlib.Path(transformers.__file__).parent / "models"
    out = []
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        for t, cls in mapping.items():
            if any(t == u for u, _ in out) or "vision" in t or "audio" in t or not isinstance(cls, str):
                continue
            if mapping is MODEL_MAPPING_NAMES and t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                continue
            mod = model_type_to_module_name(t)
            src = root / mod / f"modeling_{mod}.py"
            # composite (multimodal) configs are covered by their text types
            if (src.exists() and "experts" in src.read_text() and t in CONFIG_MAPPING
                    and "text_config" not in (getattr(CONFIG_MAPPING[t], "sub_configs", None) or {})):
                out.append((t, cls))
    return out


def _int_rule(k: str, v, d: dict):
    kl = k.lower()
    if "vocab_size" in kl:
        return VOCAB
    if kl.endswith("token_id"):
        return v if v is None or (isinstance(v, int) and v < VOCAB) else 1
    if kl in ("hidden_size", "d_model", "n_embd"):
        return HIDDEN
    if "hidden_size_per_layer" in kl or "lora_rank" in kl:
        return 8 if v else v
    if kl == "qk_head_dim":
        return 2 * HEAD_DIM
    nope = [d.get("qk_nope_head_dim")] + [c.get("qk_nope_head_dim") for c in (d.get("per_layer_config") or {}).values()]
    if kl == "head_dim" and v and d.get("qk_rope_head_dim") and any(n and v == n + d["qk_rope_head_dim"] for n in nope):
        return 2 * HEAD_DIM   # MLA: head_dim = nope + rope (of every layer, or of some per-layer config)
    if "head_dim" in kl:
        return HEAD_DIM if v != 0 else 0   # 0 means "no RoPE part" (NoPE layers)
    if kl in ("num_attention_heads", "n_heads"):
        return 4
    if kl in ("num_key_value_heads", "kv_n_heads"):
        return 2 if v and v < (d.get("num_attention_heads") or d.get("n_heads") or 1 << 30) else 4
    if "intermediate_size" in kl or "ffn_hidden_size" in kl or "ffn_dim" in kl or kl == "d_ff":
        return FFN
    if _TOPK.search(kl):
        return min(v, 2) if v else 2
    if "shared_expert" in kl and "size" not in kl:
        return min(v, 1) if v else 1
    if kl == "zero_expert_num":
        return 2
    if ("experts" in kl or kl.endswith("expert_num")) and "size" not in kl:
        return NUM_EXPERTS
    if kl in ("n_group", "num_expert_group"):
        return 2
    if kl == "topk_group":
        return 1
    if kl == "first_k_dense_replace":
        return min(v, 1) if v is not None else v
    if kl in ("sliding_window", "attention_chunk_size"):
        return 8 if v else v
    if kl.startswith(("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_chunk_size")) or kl == "ssm_state_size":
        return 8
    if kl == "mamba_dt_rank":
        return 4
    if v is None and kl.startswith("indexer_"):   # sparse-attention indexers (no defaults)
        return 1 if "kv_heads" in kl else 2 if "heads" in kl or "ratio" in kl else 4
    if kl.endswith("layer_period"):
        return 2
    if kl.endswith("layer_offset"):
        return 1
    return v


def _shrink(cfg_cls, d: dict) -> dict:
    """Keyword overrides that make ``cfg_cls(**d)`` tiny."""
    L = d.get("num_hidden_layers") or d.get("num_layers") or d.get("n_layers")
    per_layer = [v for v in d.values() if isinstance(v, list) and L and len(v) == L
                 and not all(isinstance(i, int) for i in v)]
    keep, seen = [], set()
    for i in range(L or 1):  # the first layer of every distinct combination of per-layer kinds
        sig = tuple(str(v[i]) for v in per_layer)
        if sig not in seen:
            seen.add(sig)
            keep.append(i)
    keep = keep[:4] + ([L - 1] if len(keep) < 2 and L and L > 1 else [])
    types = {f.name: str(f.type) for f in dataclasses.fields(cfg_cls)} if dataclasses.is_dataclass(cfg_cls) else {}
    kw = {}
    for k, v in d.items():
        if isinstance(v, bool):
            nv = True if k in ("enable_moe_block", "is_moe", "use_moe") else v
        elif isinstance(v, int) or (v is None and "int" in types.get(k, "")):
            nv = _int_rule(k, v, d)
        elif isinstance(v, list) and L and len(v) == L and not all(isinstance(i, int) for i in v):
            nv = [v[i] for i in keep]
        elif isinstance(v, list) and L and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v) \
                and v == sorted(set(v)) and max(v) < L:   # layer indices
            nv = [j for j, i in enumerate(keep) if i in v]
        elif isinstance(v, list) and L and len(v) == L:    # per-layer numbers
            nv = [v[i] for i in keep]
        elif isinstance(v, dict) and k == "per_layer_config":
            glob = {a: b for a, b in d.items() if a != "per_layer_config"}
            nv = {str(j): {a: b for a, b in {**c, **_shrink(dict, {**glob, **c})}.items() if a in c}
                  for j, i in enumerate(keep) for key, c in v.items() if int(key) == i}
        elif isinstance(v, dict) and k == "rope_parameters" and (
                "mrope_section" in v or "mrope_section" in getattr(cfg_cls, "ignore_keys_at_rope_validation", ())):
            # multimodal RoPE: three sections (time, height, width) that sum to the rotary half-dim
            dim = (_int_rule("qk_rope_head_dim", 1, d) if d.get("qk_rope_head_dim") else
                   _int_rule("head_dim", 1, d) if d.get("head_dim") else HIDDEN // 4)
            rot = int(dim * v.get("partial_rotary_factor", 1.0)) // 2
            nv = {**v, "mrope_section": [rot - 2 * (rot // 3), rot // 3, rot // 3]}
        elif isinstance(v, dict) and k.endswith("_config") and "model_type" in v:  # nested (DBRX)
            nv = {**v, **_shrink(dict, {**v, "n_heads": d.get("n_heads")})}
        else:
            continue
        if nv != v:
            kw[k] = nv
    for k in ("num_hidden_layers", "num_layers", "n_layers"):
        if k in d:
            kw[k] = len(keep)
    return kw


def tiny_config(model_type: str):
    """A tiny config of ``model_type`` (its defaults with every size field shrunk)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return cls(**_shrink(cls, cls().to_dict()))


def build(model_type: str, class_name: str, seed: int = 0):
    """The tiny model of ``model_type`` (float32, random weights from ``seed``, eval mode)."""
    import torch
    import transformers

    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    return getattr(transformers, class_name)(cfg).float().eval()
