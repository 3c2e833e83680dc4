"""Built-in model presets: the published `config.json` numbers of common Llama-family, Qwen3-MoE and DeepSeek models.

Each entry copies the architecture fields of the model's official Hugging Face `config.json` (the repository is
named beside it), so the planner can size memory without the weights and `create-dummy` can write a folder of the
real shape. `tiny` is ours: a few MB, for tests and demos.
"""

from __future__ import annotations

from npuserve.modelspec import ModelSpec


class UnknownPresetError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def _spec(**fields: object) -> ModelSpec:
    return ModelSpec.model_validate(fields)


MODEL_PRESETS: dict[str, ModelSpec] = {
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": _spec(model_type="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=32, head_dim=128, intermediate_size=11008, vocab_size=32000,
                       max_position_embeddings=4096, dtype="float16", rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-2-13b-hf
    "llama2-13b": _spec(model_type="llama", num_layers=40, hidden_size=5120, num_attention_heads=40,
                        num_key_value_heads=40, head_dim=128, intermediate_size=13824, vocab_size=32000,
                        max_position_embeddings=4096, dtype="float16", rms_norm_eps=1e-5, rope_theta=10000.0,
                        bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-2-70b-hf
    "llama2-70b": _spec(model_type="llama", num_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=32000,
                        max_position_embeddings=4096, dtype="float16", rms_norm_eps=1e-5, rope_theta=10000.0,
                        bos_token_id=1, eos_token_id=2),
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": _spec(model_type="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                       max_position_embeddings=8192, dtype="bfloat16", rms_norm_eps=1e-5, rope_theta=500000.0,
                       bos_token_id=128000, eos_token_id=128001),
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": _spec(model_type="llama", num_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256,
                        max_position_embeddings=8192, dtype="bfloat16", rms_norm_eps=1e-5, rope_theta=500000.0,
                        bos_token_id=128000, eos_token_id=128001),
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": _spec(model_type="qwen2", num_layers=28, hidden_size=3584, num_attention_heads=28,
                        num_key_value_heads=4, head_dim=128, intermediate_size=18944, vocab_size=152064,
                        max_position_embeddings=32768, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                        attention_bias=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen2.5-14B-Instruct
    "qwen2.5-14b": _spec(model_type="qwen2", num_layers=48, hidden_size=5120, num_attention_heads=40,
                         num_key_value_heads=8, head_dim=128, intermediate_size=13824, vocab_size=152064,
                         max_position_embeddings=32768, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                         attention_bias=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen2.5-32B-Instruct
    "qwen2.5-32b": _spec(model_type="qwen2", num_layers=64, hidden_size=5120, num_attention_heads=40,
                         num_key_value_heads=8, head_dim=128, intermediate_size=27648, vocab_size=152064,
                         max_position_embeddings=32768, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                         attention_bias=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen2.5-72B-Instruct
    "qwen2.5-72b": _spec(model_type="qwen2", num_layers=80, hidden_size=8192, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=128, intermediate_size=29568, vocab_size=152064,
                         max_position_embeddings=32768, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                         attention_bias=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen/QwQ-32B (the Qwen2.5-32B architecture with a 40960-token context)
    "qwq-32b": _spec(model_type="qwen2", num_layers=64, hidden_size=5120, num_attention_heads=40,
                     num_key_value_heads=8, head_dim=128, intermediate_size=27648, vocab_size=152064,
                     max_position_embeddings=40960, dtype="bfloat16", rms_norm_eps=1e-5, rope_theta=1000000.0,
                     attention_bias=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen3-8B
    "qwen3-8b": _spec(model_type="qwen3", num_layers=36, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                      max_position_embeddings=40960, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                      qk_norm=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen3-14B (config.json: 40 layers, hidden 5120, 40 heads / 8 KV of 128, intermediate 17408, untied LM head)
    "qwen3-14b": _spec(model_type="qwen3", num_layers=40, hidden_size=5120, num_attention_heads=40,
                       num_key_value_heads=8, head_dim=128, intermediate_size=17408, vocab_size=151936,
                       max_position_embeddings=40960, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                       qk_norm=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen3-32B
    "qwen3-32b": _spec(model_type="qwen3", num_layers=64, hidden_size=5120, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936,
                       max_position_embeddings=40960, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                       qk_norm=True, bos_token_id=151643, eos_token_id=151645),
    # mistralai/Mistral-7B-Instruct-v0.2 (no sliding window from v0.2 on)
    "mistral-7b": _spec(model_type="mistral", num_layers=32, hidden_size=4096, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
                        max_position_embeddings=32768, dtype="bfloat16", rms_norm_eps=1e-5, rope_theta=1000000.0,
                        bos_token_id=1, eos_token_id=2),
    # Qwen/Qwen3-30B-A3B (the MindSpeed-RL qwen3_30b_a3b.yaml numbers; ../shared/notes/moe-mla-lws.md)
    "qwen3-30b-a3b": _spec(model_type="qwen3_moe", num_layers=48, hidden_size=2048, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936,
                           max_position_embeddings=40960, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1000000.0,
                           qk_norm=True, bos_token_id=151643, eos_token_id=151645,
                           moe={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                "norm_topk_prob": True}),
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": _spec(model_type="qwen3_moe", num_layers=94, hidden_size=4096, num_attention_heads=64,
                             num_key_value_heads=4, head_dim=128, intermediate_size=12288, vocab_size=151936,
                             max_position_embeddings=40960, dtype="bfloat16", rms_norm_eps=1e-6,
                             rope_theta=1000000.0, qk_norm=True, bos_token_id=151643, eos_token_id=151645,
                             moe={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
                                  "norm_topk_prob": True}),
    # deepseek-ai/DeepSeek-V3 (R1 and V3-0324 share it), as bf16: the release's FP8 weights converted, since 910B
    # cards have no FP8. The MTP layer (num_nextn_predict_layers) is not served and not counted.
    "deepseek-v3": _spec(model_type="deepseek_v3", num_layers=61, hidden_size=7168, num_attention_heads=128,
                         num_key_value_heads=128, head_dim=192, intermediate_size=18432, vocab_size=129280,
                         max_position_embeddings=163840, dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=10000.0,
                         rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                         bos_token_id=0, eos_token_id=1,
                         moe={"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                              "shared_expert_intermediate_size": 2048, "norm_topk_prob": True,
                              "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
                              "routed_scaling_factor": 2.5, "first_k_dense_replace": 3},
                         mla={"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                              "qk_rope_head_dim": 64, "v_head_dim": 128}),
    # deepseek-ai/DeepSeek-V2-Lite (no q_lora; softmax greedy routing, 2 shared experts)
    "deepseek-v2-lite": _spec(model_type="deepseek_v2", num_layers=27, hidden_size=2048, num_attention_heads=16,
                              num_key_value_heads=16, head_dim=192, intermediate_size=10944, vocab_size=102400,
                              max_position_embeddings=163840, dtype="bfloat16", rms_norm_eps=1e-6,
                              rope_theta=10000.0,
                              rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                            "mscale_all_dim": 0.707},
                              bos_token_id=100000, eos_token_id=100001,
                              moe={"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
                                   "shared_expert_intermediate_size": 2816, "first_k_dense_replace": 1},
                              mla={"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                   "v_head_dim": 128}),
    # ours: a two-layer model of a few MB, GQA, small enough for unit tests on a CPU
    "tiny": _spec(model_type="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=256, vocab_size=1024, max_position_embeddings=4096,
                  dtype="float32", rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    # ours: Qwen3-MoE's shape at a few MB (16 experts, 4 per token), for CPU tests
    "tiny-qwen3-moe": _spec(model_type="qwen3_moe", num_layers=2, hidden_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=1024,
                            max_position_embeddings=4096, dtype="float32", rms_norm_eps=1e-6, rope_theta=10000.0,
                            qk_norm=True, bos_token_id=1, eos_token_id=2,
                            moe={"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                                 "norm_topk_prob": True}),
    # ours: DeepSeek-V2-Lite's shape at a few MB (no q_lora, greedy softmax routing, YaRN), runs on a CPU
    "tiny-deepseek-v2-lite": _spec(model_type="deepseek_v2", num_layers=3, hidden_size=128, num_attention_heads=4,
                                   num_key_value_heads=4, head_dim=48, intermediate_size=256, vocab_size=1024,
                                   max_position_embeddings=4096, dtype="float32", rms_norm_eps=1e-6,
                                   rope_theta=10000.0,
                                   rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                                                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                                 "mscale_all_dim": 0.707},
                                   bos_token_id=1, eos_token_id=2,
                                   moe={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                        "shared_expert_intermediate_size": 128, "first_k_dense_replace": 1},
                                   mla={"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                                        "v_head_dim": 32}),
    # ours: DeepSeek-V3's shape at a few MB (q_lora, sigmoid group-limited routing with the bias, YaRN)
    "tiny-deepseek-v3": _spec(model_type="deepseek_v3", num_layers=3, hidden_size=128, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=48, intermediate_size=256, vocab_size=1024,
                              max_position_embeddings=4096, dtype="float32", rms_norm_eps=1e-6, rope_theta=10000.0,
                              rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                              bos_token_id=1, eos_token_id=2,
                              moe={"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                                   "shared_expert_intermediate_size": 64, "norm_topk_prob": True,
                                   "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 4,
                                   "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1},
                              mla={"q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                                   "qk_rope_head_dim": 16, "v_head_dim": 32}),
}


def get_model_preset(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(MODEL_PRESETS))}"
        ) from None
