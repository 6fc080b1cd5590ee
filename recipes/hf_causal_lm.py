"""A Hugging Face causal language model of a stock family (Llama, Qwen2, Qwen3, GPT-2, and the
mixtures of experts Qwen3-MoE, Mixtral and OLMoE), built from a small config (no download),
learning to count. No pipeline hooks: under
`parallel.pp` the launcher cuts the model by its own plan and supplies the causal LM's
`split_batch` and `loss_from_output` (docs/fsdp-and-parallelism.md, 'Pipeline parallelism').

    recipe: {source: recipes/hf_causal_lm.py, model: {family: qwen3, layers: 4}}
    launch: {strategy: fsdp}
    parallel: {pp: 2}
"""

from __future__ import annotations

# The same counting task and loss as hf_gpt2 (a sibling: the launcher puts the recipe's folder
# on sys.path).
from hf_gpt2 import build_dataset, loss  # noqa: F401 (this recipe's own)
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

# Each family's names for the same small shape.
FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "gpt2": {"model_type": "gpt2"},
    # Mixtures of experts: `experts` per layer, `top_k` of them per token (`parallel.ep`
    # spreads them over processes), their load-balancing loss in the model's loss.
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16},
    "mixtral": {"model_type": "mixtral"},
    "olmoe": {"model_type": "olmoe"},
}
MOE = {"qwen3_moe", "mixtral", "olmoe"}


def build_model(
    family: str = "llama",
    vocab_size: int = 64,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    tie_word_embeddings: bool | None = None,
    experts: int = 4,
    top_k: int = 2,
    aux_loss_coef: float = 0.01,
) -> PreTrainedModel:
    """The family's model at this size; `tie_word_embeddings`: None keeps the family's
    default (GPT-2 ties its head to its input embedding; Llama and Qwen do not). A mixture of
    experts has `experts` per layer, `top_k` per token, and adds its router's load-balancing
    loss times `aux_loss_coef` to its loss (0: none)."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    extra = dict(FAMILIES[family])
    model_type = extra.pop("model_type")
    if model_type == "gpt2":
        shape = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)  # fmt: skip
    else:
        shape = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
                     pad_token_id=None)  # fmt: skip
    if family in MOE:
        shape.update(num_experts=experts, num_local_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=hidden, intermediate_size=hidden,
                     output_router_logits=aux_loss_coef > 0,
                     router_aux_loss_coef=aux_loss_coef)  # fmt: skip
    if tie_word_embeddings is not None:
        shape["tie_word_embeddings"] = tie_word_embeddings
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **shape, **extra)
    return AutoModelForCausalLM.from_config(config)
