"""Tiny random transformers models of every family models/hf.py supports, saved as HF
checkpoint directories (fp32, eager attention), for the checkpoint tests. Import it after
`pytest.importorskip("transformers")`."""

import os

import torch
import transformers

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=48, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(num_key_value_heads=2)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(num_key_value_heads=2, head_dim=16)),
    # Llama 3.x rope scaling with a short original context, so that the 4 rope frequencies of
    # head_dim 8 fall in all three bands (kept, blended, divided by the factor).
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(num_key_value_heads=2, head_dim=8,
                   rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=64))),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=16, norm_topk_prob=True)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=64,
                                              beta_fast=32, beta_slow=1, mscale=1.0,
                                              mscale_all_dim=1.0))),
    "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM,
                     dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                          n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                          index_n_heads=8, index_head_dim=8, index_topk=5)),
}


def randomize(model):
  """`model` with random weights of a trained model's scale (norms near 1), in place."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08) + ("norm" in name) * 1.0)
  return model


def hf_checkpoint(family: str, root: str, **overrides) -> str:
  """A tiny random transformers model of the family (COMMON sizes but `overrides`), saved with
  save_pretrained in <root>/<family>."""
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(0)
  config = config_cls(**{**COMMON, **extra, **overrides})
  config._attn_implementation = "eager"
  model = randomize(model_cls(config).eval())
  with torch.no_grad():
    for name, buf in model.named_buffers():
      if "e_score_correction_bias" in name:  # a saved buffer: randomise it or it goes untested
        buf.copy_(torch.rand_like(buf) * 0.05)
  path = os.path.join(root, family)
  model.save_pretrained(path)
  return path


def train_bpe_tokenizer(root, texts, vocab_size: int, special_tokens, **config) -> int:
  """A byte-level BPE tokenizer trained on `texts`, saved in `root` (tokenizer.json and a
  tokenizer_config.json of eos_token = the first special token, plus `config`); returns its
  vocabulary size."""
  import json
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(special_tokens),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tokenizer.save(os.path.join(root, "tokenizer.json"))
  with open(os.path.join(root, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": special_tokens[0], **config}, f)
  return tokenizer.get_vocab_size()
