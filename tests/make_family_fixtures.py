"""Generate the per-family Hugging Face reference fixtures in ``tests/fixtures/families/``.

Run ONCE, BY HAND, in the torch venv; the test suite never runs or imports this script (tests
need numpy + safetensors (+ tokenizers, jinja2 for the chat cases), never torch). Its outputs
are committed.

Exact command line used (from the repo root)::

    /work/torchvenv/bin/python tests/make_family_fixtures.py            # every case
    /work/torchvenv/bin/python tests/make_family_fixtures.py llama3 qwen2  # only these
    /work/torchvenv/bin/python tests/make_family_fixtures.py deepseek_v3 deepseek_v2 gpt_oss mxfp4 fp8

Versions used for the committed fixtures: torch 2.13.0+cpu, transformers 5.24.0,
safetensors 0.8.0, tokenizers 0.23.3, jinja2 3.1.6, Python 3.11 (recorded per case in
``versions.json``).

What it writes, for each case, in ``tests/fixtures/families/<case>/``:

* ``config.json`` + ``model.safetensors``: ``save_pretrained(dir, safe_serialization=True)``
  of ``AutoModelForCausalLM.from_config(config, attn_implementation="eager")``, float32.
  ``config.json`` is transformers 5.x style (``rope_parameters``).
* ``generation_config.json``: written by this script (not by ``save_pretrained``):
  ``{"bos_token_id": ..., "eos_token_id": ...}`` as the case's model card would have it
  (``llama3``: the list ``[1, 2, 3]`` like Llama 3.1's three end ids; ``qwen2``: ``[2, 0]``
  like Qwen2.5-Instruct's ``[<|im_end|>, <|endoftext|>]``; the others: the int 2).
* ``reference.npz`` (``np.savez``, every entry a plain numeric array, so it loads with
  ``allow_pickle=False``):

  - ``input_ids`` int64 [2, 40] (``torch.Generator().manual_seed(1234)``), and ``logits``
    float32 [2, 40, vocab] = ``model(input_ids).logits``: eval, ``torch.no_grad()``, eager
    attention, no attention mask (full causal attention, plus each layer's sliding window).
    T = 40 is past every ``original_max_position_embeddings`` (16) and sliding window (8).
  - ``prompt_ids`` int64 [1, P] and ``greedy_ids`` int64 [1, 12]: the
    new tokens of ``model.generate(prompt_ids, attention_mask=ones, do_sample=False,
    max_new_tokens=12)``. End-of-sequence is DISABLED so it runs all 12 steps: the in-memory
    ``model.generation_config.eos_token_id`` is set to None before ``generate`` (passing
    ``eos_token_id=None`` to ``generate`` does nothing in 5.x: None kwargs are filled from the
    model's generation config; ``min_new_tokens`` would instead mask the eos logits and change
    the greedy choice). The script checks that the tokens equal a plain argmax loop over full
    forwards, and that every step's top-1 logit beats the top-2 by at least ``MIN_MARGIN``
    (so a float32 re-implementation cannot flip a choice). The prompt is drawn with
    ``torch.Generator().manual_seed(s)`` for the first s from 4321 up whose run has at least 6
    distinct new tokens (a random model that repeats one token cannot tell a broken KV cache
    from a working one) and passes the margin check: 4321 for every case but gemma2 (4323) and
    deepseek_v2 (4322).
    P = 8 (so 8 + 12 positions pass the window 8 and the original 16 positions);
    ``phi3_longrope``: P = 20 (see below).
  - ``phi3_longrope`` only: ``input_ids_short`` [2, 12] and ``logits_short``: transformers
    picks LongRoPE's short or long factors by sequence length (``max(position_ids) + 1 >
    original_max_position_embeddings`` -> long), so T = 12 runs on the short factors and
    T = 40 on the long ones. The greedy prompt is 20 tokens so prefill and every decode step
    use the long factors (a prompt that crosses 16 while decoding makes ``generate`` mix
    short-factor keys in the cache with long-factor queries, which a full recompute does not).
  - chat cases (``llama3``, ``qwen2``): ``chat_ids_0``, ``chat_ids_1`` int64 [n]: transformers'
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``
    of the two conversations in ``chat.json``.
* chat cases also: ``tokenizer.json`` (a byte-level BPE trained here with the ``tokenizers``
  package on ``CORPUS``, its vocab within the model's, with the real model's pre-tokenizer
  split regex; the script checks that transformers' ids equal those of the tokenizer.json
  alone), ``tokenizer_config.json`` (written
  here: ``tokenizer_class``, the special tokens and the ``chat_template`` string), and
  ``chat.json`` (``{"messages": [conv0, conv1], "rendered": [text0, text1], "chat_ids":
  [...]}``; ``rendered`` is ``apply_chat_template(..., tokenize=False)``). The templates are
  written here in the style of Llama 3.1 and Qwen2.5 (not copied from the Hub); the Llama one
  uses ``bos_token``, ``| trim``, ``raise_exception`` and ``{%- -%}`` whitespace control, the
  ChatML one plain indented ``{% %}`` tags, so it only renders right with
  ``trim_blocks``/``lstrip_blocks``. The Llama tokenizer's post-processor adds
  ``<|begin_of_text|>`` (as Llama 3's does), so adding special tokens again after rendering
  would show as a second BOS.
* ``versions.json``: torch / transformers / safetensors / tokenizers / jinja2 / numpy.

Weights: ``torch.manual_seed(0)`` before each model is built; ``initializer_range`` 0.2 (HF's
0.02 leaves logits ~0 and attention uniform). Then every norm weight is perturbed away from 1
(``normal_(1.0, 0.2)``; Gemma 2's (1 + w) norms: w ``normal_(0.0, 0.2)``) and every bias away
from 0 (``normal_(0.0, 0.1)``; GPT-OSS's ``*_bias`` too, DeepSeek-V3's ``e_score_correction_bias``
buffer likewise; GPT-OSS's ``sinks`` ``normal_(0.0, 1.0)``), so a missing norm offset or bias shows in the logits. Gemma 2's
post-attention and post-feedforward norms get w ``normal_(2.0, 0.2)`` (a scale of about 3):
with w around 0 the sqrt(hidden)-scaled embedding swamps the layers' normalised outputs and,
through the tied head, a token often predicts itself (21% of positions), so greedy decoding
repeats one token.

Cases (hidden 64, intermediate 128, 4 heads / 2 kv heads unless said; all ~0.4-0.7 MB):

============== =========================================================================
llama3         llama, rope_type llama3 (factor 8, low 1, high 2, original 16, theta 5e5),
               head_dim 32 (2 heads / 1 kv), 3 layers, tied head, eos [1, 2, 3], vocab
               384, Llama-3-style chat template
llama_linear   llama, rope_type linear factor 2, untied
mistral        mistral, sliding_window 8, head_dim 32 (4 x 32 = 128 != hidden 64)
qwen2          qwen2, q/k/v biases, tied head, use_sliding_window false, eos [2, 0],
               vocab 384, ChatML template
qwen3          qwen3, per-head q/k RMSNorm, head_dim 32, untied
phi3           phi3, fused qkv_proj / gate_up_proj, default RoPE (partial_rotary_factor 1),
               4 kv heads, sliding_window null (Phi-3-mini's own config has 2047)
phi3_longrope  phi3, longrope (8 short + 8 long factors), original 16, max positions 64
gemma2         gemma2, 4 layers (sliding, full, sliding, full; window 8), head_dim 16,
               query_pre_attn_scalar 24, attn soft-cap 4, final soft-cap 8 (small, so they
               matter), gelu_pytorch_tanh, tied head, eps 1e-6
mixtral        mixtral, 4 experts top-2, intermediate 64, sliding_window null; saved in the
               Hub's per-expert layout (block_sparse_moe.experts.N.w1/w2/w3, .gate)
gemma3         gemma3_text, 4 layers (sliding, full, sliding, full; window 8), head_dim 16,
               query_pre_attn_scalar 24, global RoPE linear x8 at 1e6, LOCAL base 100 (the
               real 10 000 barely differs from 1e6 over 40 positions of head_dim 16), per-head
               (1 + w) q/k norms, no soft-caps, tied head, eps 1e-6
olmo2          olmo2, post-norms only, q/k RMSNorm over the whole projections (64 and 32
               values), theta 5e5, eps 1e-6
granite        granite, embedding_multiplier 3, residual_multiplier 0.5, attention_multiplier
               0.3, logits_scaling 4, tied head
qwen3_moe      qwen3_moe, 3 layers (MoE, dense, MoE: mlp_only_layers [1]), 4 experts top-2,
               moe_intermediate 48, dense intermediate 96, norm_topk_prob FALSE, head_dim 32
qwen3_moe_fused  as qwen3_moe with norm_topk_prob true, saved in transformers 5's fused layout
               (save_pretrained(save_original_format=False): mlp.experts.gate_up_proj [E, 2I, C],
               mlp.experts.down_proj [E, C, I]); I = 48 != C = 64 so a transposed read fails
mixtral_fused  mixtral, intermediate 48, in the fused layout likewise (mlp.gate, mlp.experts.*)
gemma3_mm      gemma3 (multimodal: Gemma3ForConditionalGeneration), a 1-layer SigLIP vision tower
               and projector beside a text model shaped as gemma3's (4 layers); saved in the
               Hub's layout (language_model.model.*, vision_tower.*, multi_modal_projector.*);
               logits of text-only input (image token id 1000, past the vocabulary); its greedy run
               needs only 4 distinct tokens (the gemma3 case tests the cache with 6)
deepseek_v3    deepseek_v3, 3 layers (first_k_dense_replace 1, dense width 96), MLA: q_lora_rank
               24, kv_lora_rank 16, rope/nope/v head dims 8/16/12, interleaved RoPE, yarn
               (factor 4, original 16, mscale 0.8, mscale_all_dim 1.0); 8 experts of 32 in 4
               groups, topk_group 2, top-2, 2 shared, routed_scaling_factor 2.5; saved per
               expert (mlp.experts.N.gate_proj, mlp.gate.e_score_correction_bias)
deepseek_v2    deepseek_v2, 2 layers, q_lora_rank null (q_proj), group_limited_greedy (4 groups,
               topk_group 1), norm_topk_prob false, routed_scaling_factor 1.5, 1 shared, yarn
gpt_oss        gpt_oss, 4 layers (sliding 8 / full alternating), head_dim 16, sinks, q/k/v/o
               biases, yarn (factor 4, original 16, truncate false), 4 experts of 32 top-2 with
               biases, swiglu_limit 1.0 (so the clamp acts); saved fused (mlp.experts.gate_up_proj
               [E, C, 2I], gate/up interleaved; down_proj [E, I, C]; ``_bias``)
============== =========================================================================

Prompt seeds (see above): gemma3 4335, qwen3_moe 4322, the other new cases 4321. Gemma 3's
norms are perturbed as Gemma 2's (w around 0; post-norms around 2), q/k norms included.

``mxfp4`` (a name beside the cases): ``tests/fixtures/mxfp4.npz`` (random MXFP4 blocks and scales
with transformers' ``convert_moe_packed_tensors`` output) and ``families/gpt_oss_mxfp4/`` (the
gpt_oss case with MXFP4 experts, saved as the Hub stores them; ``build_mxfp4``). ``fp8``:
``families/deepseek_v3_fp8/`` (the deepseek_v3 case with FP8 block-scaled weights as the Hub's
DeepSeek-V3 stores them; ``build_fp8``).

Checks done here: the saved model reloads to the same logits exactly; taking away each
feature a case must exercise (``FEATURES``: llama3/linear RoPE scaling, the sliding window,
Qwen2's biases, Qwen3's q/k norms, each Gemma 2 soft-cap, its alternate-layer window and
``query_pre_attn_scalar``, Mixtral's top-2; Gemma 3's local base, global linear scaling,
window, scalar and q/k norms; OLMo 2's q/k norm weights; each Granite multiplier; Qwen3-MoE's
top-2, norm_topk_prob and q/k norms; DeepSeek's grouped top-k, correction bias, scaling
factor, shared experts, yarn and interleaved RoPE, V2's group-limited routing, GPT-OSS's sinks,
window, clamp, expert biases and yarn) moves the logits by more than 0.1, so the fixture
catches an implementation that ignores it; LongRoPE's short and long factors give different
logits; the greedy checks above. Everything is printed.
"""

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "families")

T_LONG, T_SHORT = 40, 12
PROMPT_LEN, NEW_TOKENS = 8, 12
MIN_MARGIN = 1e-3
MIN_DISTINCT = 6

BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2,
            bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def rope(rope_type="default", theta=10000.0, **kw):
    return {"rope_type": rope_type, "rope_theta": theta, **kw}


def _longrope_factors():
    rng = np.random.default_rng(7)
    short = (1.0 + 0.2 * rng.random(8)).round(4).tolist()  # head_dim 16 -> 8 factors
    long = np.geomspace(1.0, 12.0, 8).round(4).tolist()
    return short, long


SHORT_F, LONG_F = _longrope_factors()

CASES = {
    # Llama 3.1: llama3 RoPE. head_dim 32 with theta 500000 puts inv_freq wavelengths (6.3, 14.3,
    # 32.4, ...) in all three llama3 bands: high_freq_factor 2 -> below 16/2 = 8 unchanged,
    # between 8 and 16 smoothed, above 16 divided by factor 8. (high_freq_factor 4 as in the real
    # models would leave the "unchanged" band empty: no wavelength is below 2*pi.)
    "llama3": dict(model_type="llama", vocab_size=384, num_hidden_layers=3, num_attention_heads=2,
                   num_key_value_heads=1, tie_word_embeddings=True, eos_token_id=[1, 2, 3],
                   rope_parameters=rope("llama3", 500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=2.0, original_max_position_embeddings=16),
                   max_position_embeddings=256,  # room for the chat prompts
                   _generation={"bos_token_id": 0, "eos_token_id": [1, 2, 3]}, _chat="llama3"),
    "llama_linear": dict(model_type="llama", vocab_size=256, num_hidden_layers=2,
                         rope_parameters=rope("linear", 10000.0, factor=2.0)),
    "mistral": dict(model_type="mistral", vocab_size=256, num_hidden_layers=2, head_dim=32,
                    sliding_window=8, rope_parameters=rope("default", 1000000.0)),
    "qwen2": dict(model_type="qwen2", vocab_size=384, num_hidden_layers=2, tie_word_embeddings=True,
                  use_sliding_window=False, eos_token_id=2, rope_parameters=rope("default", 1000000.0),
                  max_position_embeddings=256,  # room for the chat prompts
                  _generation={"bos_token_id": 0, "eos_token_id": [2, 0]}, _chat="chatml"),
    "qwen3": dict(model_type="qwen3", vocab_size=256, num_hidden_layers=2, head_dim=32,
                  use_sliding_window=False, rope_parameters=rope("default", 1000000.0)),
    "phi3": dict(model_type="phi3", vocab_size=256, num_hidden_layers=2, num_key_value_heads=4,
                 original_max_position_embeddings=64, rope_parameters=rope("default", 10000.0)),
    "phi3_longrope": dict(model_type="phi3", vocab_size=256, num_hidden_layers=2,
                          num_key_value_heads=4, original_max_position_embeddings=16,
                          rope_parameters=rope("longrope", 10000.0, short_factor=SHORT_F,
                                               long_factor=LONG_F)),
    "gemma2": dict(model_type="gemma2", vocab_size=256, num_hidden_layers=4, head_dim=16,
                   query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
                   sliding_window=8, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                   rms_norm_eps=1e-6, rope_parameters=rope("default", 10000.0)),
    "mixtral": dict(model_type="mixtral", vocab_size=256, num_hidden_layers=2, intermediate_size=64,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                    router_jitter_noise=0.0, rope_parameters=rope("default", 1000000.0)),
    # -- issue 31, part 1 --
    "gemma3": dict(model_type="gemma3_text", vocab_size=256, num_hidden_layers=4, head_dim=16,
                   query_pre_attn_scalar=24, sliding_window=8, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
                   rms_norm_eps=1e-6,
                   rope_parameters={"full_attention": rope("linear", 1000000.0, factor=8.0),
                                    "sliding_attention": rope("default", 100.0)}),
    "olmo2": dict(model_type="olmo2", vocab_size=256, num_hidden_layers=2, rms_norm_eps=1e-6,
                  rope_parameters=rope("default", 500000.0)),
    "granite": dict(model_type="granite", vocab_size=256, num_hidden_layers=2, tie_word_embeddings=True,
                    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                    logits_scaling=4.0, rope_parameters=rope("default", 10000.0)),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=256, num_hidden_layers=3, head_dim=32,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                      mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=False,
                      use_sliding_window=False, rope_parameters=rope("default", 1000000.0)),
    # Gemma 3 as published for 4B-27B: Gemma3ForConditionalGeneration, a SigLIP vision tower beside
    # the language model (text_config); the image token id lies past the vocabulary, so no random
    # prompt holds one (the logits are the text path's)
    "gemma3_mm": dict(model_type="gemma3", mm_tokens_per_image=4, boi_token_index=253, eoi_token_index=254,
                      image_token_index=1000, _min_distinct=4,  # (no seed up to 4340 gives 6; gemma3 has)
                      vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
                      _text=dict(vocab_size=256, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24,
                                 sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                                 tie_word_embeddings=True, rms_norm_eps=1e-6,
                                 rope_parameters={"full_attention": rope("linear", 1000000.0, factor=8.0),
                                                  "sliding_attention": rope("default", 100.0)})),
    # the same models saved in transformers 5's fused expert layout (save_original_format=False)
    "qwen3_moe_fused": dict(model_type="qwen3_moe", vocab_size=256, num_hidden_layers=3, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                            mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True,
                            use_sliding_window=False, rope_parameters=rope("default", 1000000.0), _fused=True),
    "mixtral_fused": dict(model_type="mixtral", vocab_size=256, num_hidden_layers=2, intermediate_size=48,
                          num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                          router_jitter_noise=0.0, rope_parameters=rope("default", 1000000.0), _fused=True),
    # DeepSeek-V3: MLA with q_lora_rank, yarn (mscale != mscale_all_dim: both the cos/sin factor
    # and the softmax temperature move), interleaved RoPE; 1 dense layer then 2 MoE layers of 8
    # experts in 4 groups (top-2 groups), top-2, 2 shared experts, routed_scaling_factor 2.5
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=256, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        rope_interleave=True,
                        rope_parameters=rope("yarn", 10000.0, factor=4.0, original_max_position_embeddings=16,
                                             mscale=0.8, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)),
    # DeepSeek-V2-Lite style: q_lora_rank null (one q_proj), softmax group_limited_greedy routing,
    # never renormalised, routed_scaling_factor 1.5, 1 shared expert, yarn. topk_group 1: with a group
    # scored by its best expert, top-2 within the best 2 groups is plain top-2 (no test)
    "deepseek_v2": dict(model_type="deepseek_v2", vocab_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=1,
                        topk_method="group_limited_greedy", first_k_dense_replace=1, routed_scaling_factor=1.5,
                        norm_topk_prob=False, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=12,
                        rope_parameters=rope("yarn", 10000.0, factor=4.0, original_max_position_embeddings=16,
                                             mscale=0.707, mscale_all_dim=0.707)),
    # GPT-OSS: sinks, q/k/v/o biases, sliding (window 8) / full layers, yarn (truncate false),
    # 4 experts top-2 with biases, swiglu_limit 1.0 (small, so the clamp acts)
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters=rope("yarn", 150000.0, factor=4.0, original_max_position_embeddings=16,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False)),
}
FIRST = ("llama3", "mistral", "qwen2")

# -- chat templates ------------------------------------------------------------------------------
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Conversation roles must be user or assistant after the system message, got " + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
    {% set loop_messages = messages %}
{% endif %}
<|im_start|>system
{{ system }}<|im_end|>
{% for message in loop_messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unexpected role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# the split regexes of Llama 3's tokenizer.json and of transformers' Qwen2Tokenizer (digits: up
# to three per piece vs one)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT = {
    "llama3": dict(template=LLAMA3_TEMPLATE, split=LLAMA3_SPLIT, normalizer=None,
                   tokenizer_class="PreTrainedTokenizerFast",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>",
                            "<|start_header_id|>", "<|end_header_id|>"],
                   config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                   bos_post_processor="<|begin_of_text|>"),
    "chatml": dict(template=CHATML_TEMPLATE, split=QWEN2_SPLIT, normalizer="NFC",
                   tokenizer_class="Qwen2Tokenizer",
                   special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                           "unk_token": None},
                   bos_post_processor=None),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant. "},
     {"role": "user", "content": "  Name two prime numbers.\n"},
     {"role": "assistant", "content": "2 and 3."},
     {"role": "user", "content": "And one more, s'il vous plaît? Grüße 🙂"}],
]
CORPUS = [
    "What is the capital of France? Paris is the capital of France.",
    "You are a helpful assistant. You are a terse assistant.",
    "Name two prime numbers. 2 and 3 are prime numbers. And one more: 5.",
    "Cutting Knowledge Date: December 2023. Today Date: 26 Jul 2024.",
    "system user assistant Qwen Alibaba Cloud s'il vous plaît Grüße",
] * 3
TOKENIZER_VOCAB = 380  # at most the chat models' vocab of 384


def build_tokenizer(spec):
    """A byte-level BPE with the real model's pipeline: its split regex, then byte-level
    (Qwen2 also NFC-normalises). transformers 5 rebuilds the pipeline of a ``Qwen2Tokenizer``
    from its own code, ignoring tokenizer.json's, so a tokenizer.json that differs from it
    would give transformers and the tokenizers package different ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if spec["normalizer"] == "NFC":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, min_frequency=1,
                                  special_tokens=spec["special"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    bos = spec["bos_post_processor"]
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for i, s in enumerate(spec["special"]):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_chat(out, case, vocab_size):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    spec = CHAT[case["_chat"]]
    tok = build_tokenizer(spec)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {"tokenizer_class": spec["tokenizer_class"], "model_max_length": 256,
           "clean_up_tokenization_spaces": False, **spec["config"], "chat_template": spec["template"]}
    _dump(os.path.join(out, "tokenizer_config.json"), cfg)
    hf = AutoTokenizer.from_pretrained(out)
    print(f"  transformers loads {type(hf).__name__}; special tokens {hf.special_tokens_map}")
    raw = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    rendered, ids = [], []
    for conv in CONVERSATIONS:
        text = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        enc = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        enc = enc["input_ids"] if hasattr(enc, "keys") else enc
        assert enc == hf(text, add_special_tokens=False)["input_ids"]
        # the tokenizer.json alone (what rlx_mpi reads) gives the same ids
        assert enc == raw.encode(text, add_special_tokens=False).ids, (enc, raw.encode(text).tokens)
        rendered.append(text)
        ids.append([int(i) for i in enc])
    # the template's BOS is there once; the tokenizer alone would add another one
    if spec["bos_post_processor"]:
        assert ids[0].count(0) == 1 and hf(rendered[0])["input_ids"][:2] == [0, 0]
    _dump(os.path.join(out, "chat.json"), {"messages": CONVERSATIONS, "rendered": rendered,
                                           "chat_ids": ids, "add_generation_prompt": True})
    for text, i in zip(rendered, ids):
        print(f"  chat ({len(i)} ids): {text!r}")
    return {f"chat_ids_{k}": np.asarray(v, dtype=np.int64) for k, v in enumerate(ids)}


# -- the models ----------------------------------------------------------------------------------

def make_model(case):
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    kw = {**BASE, **{k: v for k, v in case.items() if not k.startswith("_")}}
    model_type = kw.pop("model_type")
    if "_text" in case:  # a multimodal config: BASE and _text make its text_config
        kw = {k: v for k, v in case.items() if not k.startswith("_") and k != "model_type"}
        kw["text_config"] = {**BASE, **case["_text"]}
    config = CONFIG_MAPPING[model_type](**kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    assert model.config._attn_implementation == "eager"
    gemma = model_type in ("gemma2", "gemma3_text", "gemma3")
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a buffer that steers the choice
                b.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 2)[-2] if "." in name else name
            if name.endswith("sinks"):  # GPT-OSS: about the size of a score, so some mass goes there
                p.normal_(0.0, 1.0)
            elif name.endswith(".bias") or name.endswith("_bias"):
                p.normal_(0.0, 0.1)
            elif gemma and leaf in ("post_attention_layernorm", "post_feedforward_layernorm"):
                p.normal_(2.0, 0.2)  # see the module docstring
            elif "norm" in leaf:
                p.normal_(0.0, 0.2) if gemma else p.normal_(1.0, 0.2)
    return model


def forward(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def pick_greedy(model, plen, min_distinct=MIN_DISTINCT):
    """The first prompt seed from 4321 up whose greedy run is a useful test; its (prompt, tokens).

    Useful: at least ``MIN_DISTINCT`` distinct new tokens (a random model that repeats one token
    cannot tell a broken KV cache from a working one) and every margin above ``MIN_MARGIN``.
    """
    import torch

    vocab = model.config.get_text_config().vocab_size
    for seed in range(4321, 4341):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, vocab, (1, plen), generator=gen).numpy().astype(np.int64)
        new, margin = greedy(model, prompt)
        print(f"  prompt seed {seed}: greedy {new[0].tolist()}  min top1-top2 margin {margin:.4f}")
        if len(set(new[0].tolist())) >= min_distinct and margin > MIN_MARGIN:
            return prompt, new
    raise SystemExit("no prompt seed gave a useful greedy run")


def greedy(model, prompt):
    """generate(do_sample=False) with eos disabled, checked against an argmax loop."""
    import torch

    model.generation_config.eos_token_id = None
    prompt_t = torch.as_tensor(prompt)
    with torch.no_grad():
        full = model.generate(prompt_t, attention_mask=torch.ones_like(prompt_t), do_sample=False,
                              max_new_tokens=NEW_TOKENS, pad_token_id=0)
    new = full[:, prompt.shape[1]:].numpy()
    assert new.shape == (1, NEW_TOKENS), new.shape
    ids, margins = prompt.copy(), []
    for _ in range(NEW_TOKENS):
        last = forward(model, ids)[0, -1]
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        ids = np.concatenate([ids, [[int(last.argmax())]]], axis=1)
    assert (ids[:, prompt.shape[1]:] == new).all(), (ids, new)
    return new.astype(np.int64), min(margins)


# What each case must exercise: taking it away (a config override, or weights set to the value
# that makes them a no-op) must move the T=40 logits by more than 0.1, or the fixture could not
# catch an implementation that ignores it.
FEATURES = {
    "llama3": [("llama3 RoPE scaling", {"rope_parameters": rope("default", 500000.0)}, None)],
    "llama_linear": [("linear RoPE scaling", {"rope_parameters": rope("default", 10000.0)}, None)],
    "mistral": [("sliding window", {"sliding_window": None}, None)],
    "qwen2": [("q/k/v biases", {}, ("bias", 0.0))],
    "qwen3": [("q/k norms", {}, ("_norm.", 1.0))],
    "gemma2": [("attention soft-cap", {"attn_logit_softcapping": None}, None),
               ("final soft-cap", {"final_logit_softcapping": None}, None),
               ("sliding window on alternate layers", {"sliding_window": 4096}, None),
               ("query_pre_attn_scalar", {"query_pre_attn_scalar": 16}, None)],
    "mixtral": [("top-2 routing", {"num_experts_per_tok": 1}, None)],
    "gemma3": [("local RoPE base", {"rope_parameters": {"full_attention": rope("linear", 1000000.0, factor=8.0),
                                                        "sliding_attention": rope("default", 1000000.0)}}, None),
               ("linear scaling of the global base", {"rope_parameters": {
                   "full_attention": rope("default", 1000000.0), "sliding_attention": rope("default", 100.0)}}, None),
               ("sliding window", {"sliding_window": 4096}, None),
               ("query_pre_attn_scalar", {"query_pre_attn_scalar": 16}, None),
               ("q/k norms", {}, ("_norm.", 0.0))],
    "olmo2": [("q/k norm weights", {}, ("_norm.", 1.0))],
    "granite": [("embedding_multiplier", {"embedding_multiplier": 1.0}, None),
                ("residual_multiplier", {"residual_multiplier": 1.0}, None),
                ("attention_multiplier", {"attention_multiplier": 32 ** -0.5}, None),
                ("logits_scaling", {"logits_scaling": 1.0}, None)],
    "qwen3_moe": [("top-2 routing", {"num_experts_per_tok": 1}, None),
                  ("norm_topk_prob false", {"norm_topk_prob": True}, None),
                  ("q/k norms", {}, ("_norm.", 1.0))],
    "qwen3_moe_fused": [("top-2 routing", {"num_experts_per_tok": 1}, None)],
    "mixtral_fused": [("top-2 routing", {"num_experts_per_tok": 1}, None)],
    "deepseek_v3": [("yarn RoPE", {"rope_parameters": rope("default", 10000.0)}, None),
                    ("grouped top-k", {"n_group": 1, "topk_group": 1}, None),
                    ("e_score_correction_bias", {}, ("e_score_correction_bias", 0.0)),
                    ("routed_scaling_factor", {"routed_scaling_factor": 1.0}, None),
                    ("shared experts", {}, ("shared_experts.down_proj", 0.0)),
                    ("rope_interleave", {"rope_interleave": False}, None)],
    "deepseek_v2": [("group_limited_greedy", {"topk_method": "greedy"}, None),
                    ("routed_scaling_factor", {"routed_scaling_factor": 1.0}, None)],
    "gpt_oss": [("attention sinks", {}, ("sinks", -1e4)),
                ("sliding window", {"sliding_window": 4096}, None),
                ("swiglu_limit", {"swiglu_limit": 1e4}, None),
                ("expert biases", {}, ("gate_up_proj_bias", 0.0)),
                ("yarn RoPE", {"rope_parameters": rope("default", 150000.0)}, None)],
}


def check_features(name, model, ids, logits):
    """Each of the case's FEATURES moves the logits; the unchanged copy reproduces them exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    def variant(override, weights):
        cfg = type(model.config).from_dict({**model.config.to_dict(), **override})
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if weights:
            part, value = weights
            for k in state:
                if part in k:
                    state[k].fill_(value)
        m.load_state_dict(state)
        return float(np.abs(forward(m, ids) - logits).max())

    assert variant({}, None) == 0.0
    for what, override, weights in FEATURES.get(name, []):
        diff = variant(override, weights)
        print(f"  without {what}: logits move by {diff:.3f}")
        assert diff > 0.1, (what, diff)


def build(name):
    import jinja2
    import safetensors
    import tokenizers
    import torch
    import transformers
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    case = CASES[name]
    out = os.path.join(OUT, name)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.unlink(os.path.join(out, f))
    model = make_model(case)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1234)
    ref = {"input_ids": torch.randint(0, vocab, (2, T_LONG), generator=gen).numpy().astype(np.int64)}
    ref["logits"] = forward(model, ref["input_ids"])
    if case["model_type"] == "phi3" and case["rope_parameters"]["rope_type"] == "longrope":
        ref["input_ids_short"] = ref["input_ids"][:, :T_SHORT].copy()
        ref["logits_short"] = forward(model, ref["input_ids_short"])
        # the short factors differ from the long ones: the first 12 positions of the T=40 run
        moved = float(np.abs(ref["logits_short"] - ref["logits"][:, :T_SHORT]).max())
        print(f"  short vs long factors on the first {T_SHORT} positions: {moved:.3f}")
        assert moved > 0.1
        plen = 20
    else:
        plen = PROMPT_LEN
    check_features(name, model, ref["input_ids"], ref["logits"])
    ref["prompt_ids"], ref["greedy_ids"] = pick_greedy(model, plen, case.get("_min_distinct", MIN_DISTINCT))

    # _fused: transformers 5's own layout (mlp.experts.gate_up_proj [E, 2I, C], down_proj [E, C, I])
    model.save_pretrained(out, safe_serialization=True, save_original_format=not case.get("_fused", False))
    if os.path.exists(os.path.join(out, "generation_config.json")):
        os.unlink(os.path.join(out, "generation_config.json"))
    _dump(os.path.join(out, "generation_config.json"),
          case.get("_generation", {"bos_token_id": 0, "eos_token_id": 2}))
    if "_chat" in case:
        ref.update(write_chat(out, case, vocab))
    ref = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v.astype(np.int64)) for k, v in ref.items()}
    np.savez(os.path.join(out, "reference.npz"), **ref)
    _dump(os.path.join(out, "versions.json"), {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__,
        "jinja2": jinja2.__version__, "numpy": np.__version__})

    # ---- report + verification
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    print("  config.json:", json.dumps(saved, sort_keys=True))
    tensors = load_file(os.path.join(out, "model.safetensors"))
    for k in sorted(tensors)[:40]:
        print(f"    {k:55s} {tensors[k].shape}")
    print("  files:", {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))})
    print("  logits max |.| %.3f std %.3f" % (np.abs(ref["logits"]).max(), ref["logits"].std()))
    back = np.load(os.path.join(out, "reference.npz"), allow_pickle=False)
    assert sorted(back.files) == sorted(ref)
    re = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    diff = float(np.abs(forward(re, back["input_ids"]) - back["logits"]).max())
    print("  reload max abs diff:", diff)
    assert diff == 0.0, diff


def _dump(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")


def build_mxfp4():
    """GPT-OSS's MXFP4 experts, decoded by transformers' own ``convert_moe_packed_tensors``:

    * ``tests/fixtures/mxfp4.npz``: random ``blocks`` uint8 [2, 6, 2, 16], ``scales`` uint8
      [2, 6, 2] (120..131) and ``dequantized`` float32 [2, 64, 6] (transformers' output, (E, in, out)).
    * ``families/gpt_oss_mxfp4/``: the ``gpt_oss`` case's model (same seed and perturbation) with
      every expert's gate_up / down replaced by random MXFP4 (scales 121..124) that transformers
      dequantizes; saved the Hub's way: ``mlp.experts.{gate_up,down}_proj_{blocks,scales}``, the
      biases and everything else as float32, ``quantization_config`` {quant_method: mxfp4};
      ``reference.npz``: ``input_ids`` [2, 40] (seed 1234) and transformers' ``logits``.
    """
    import torch
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(77)
    blocks = torch.randint(0, 256, (2, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 132, (2, 6, 2), generator=g).to(torch.uint8)
    deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    np.savez(os.path.join(HERE, "fixtures", "mxfp4.npz"), blocks=blocks.numpy(), scales=scales.numpy(),
             dequantized=deq.numpy().astype(np.float32))
    print("  mxfp4.npz:", tuple(deq.shape), "max", float(deq.abs().max()))

    case = CASES["gpt_oss"]
    model = make_model(case)
    packed = {}
    with torch.no_grad():
        for n, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            E, H, I2 = ex.gate_up_proj.shape
            I = I2 // 2
            for proj, rows, cols in (("gate_up_proj", I2, H), ("down_proj", H, I)):
                b = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
                sc = torch.randint(121, 125, (E, rows, cols // 32), generator=g).to(torch.uint8)
                getattr(ex, proj).copy_(convert_moe_packed_tensors(b, sc, dtype=torch.float32))
                packed[f"model.layers.{n}.mlp.experts.{proj}_blocks"] = b.numpy()
                packed[f"model.layers.{n}.mlp.experts.{proj}_scales"] = sc.numpy()
    out = os.path.join(OUT, "gpt_oss_mxfp4")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.unlink(os.path.join(out, f))
    ids = torch.randint(0, model.config.vocab_size, (2, T_LONG), generator=torch.Generator().manual_seed(1234))
    logits = forward(model, ids.numpy())
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()
             if not k.endswith("experts.gate_up_proj") and not k.endswith("experts.down_proj")}
    save_file({**state, **packed}, os.path.join(out, "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    _dump(os.path.join(out, "config.json"), config)
    np.savez(os.path.join(out, "reference.npz"), input_ids=ids.numpy().astype(np.int64), logits=logits)
    print("  gpt_oss_mxfp4:", sorted(packed)[:2], "logits max |.| %.3f" % np.abs(logits).max())


def build_fp8():
    """``families/deepseek_v3_fp8/``: the ``deepseek_v3`` case's model (same seed and perturbation)
    with every linear weight but the embedding, head and routers stored the way the Hub's
    DeepSeek-V3 is: float8 e4m3fn with a float32 ``weight_scale_inv`` per 128 x 128 block
    (the block's max |w| / 448), ``quantization_config`` {quant_method: fp8, fmt: e4m3,
    weight_block_size: [128, 128]}. The model runs on the weights transformers'
    ``finegrained_fp8._dequantize_fp8_weight`` gives back; ``reference.npz``: ``input_ids`` [2, 40]
    (seed 1234) and its ``logits``."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    model = make_model(CASES["deepseek_v3"])
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)  # the Hub's per-expert names
        dense = load_file(os.path.join(tmp, "model.safetensors"))
        state = {}
        for name, p in dense.items():
            if p.ndim != 2 or "embed_tokens" in name or "lm_head" in name or name.endswith("mlp.gate.weight"):
                state[name] = p
                continue
            rows, cols = p.shape
            grid = (-(-rows // 128), -(-cols // 128))
            pad = torch.zeros(grid[0] * 128, grid[1] * 128)
            pad[:rows, :cols] = p
            scale = (pad.abs().reshape(grid[0], 128, grid[1], 128).amax(dim=(1, 3)).clamp(min=1e-12) / 448.0).float()
            q = (p / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]).to(torch.float8_e4m3fn)
            dense[name] = _dequantize_fp8_weight(q, scale, [128, 128], torch.float32)
            state[name], state[name + "_scale_inv"] = q, scale
        save_file(dense, os.path.join(tmp, "model.safetensors"))  # what transformers' dequantization gives
        model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32).eval()
    out = os.path.join(OUT, "deepseek_v3_fp8")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.unlink(os.path.join(out, f))
    ids = torch.randint(0, model.config.vocab_size, (2, T_LONG), generator=torch.Generator().manual_seed(1234))
    logits = forward(model, ids.numpy())
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    _dump(os.path.join(out, "config.json"), config)
    np.savez(os.path.join(out, "reference.npz"), input_ids=ids.numpy().astype(np.int64), logits=logits)
    fp8 = sorted(k for k, v in state.items() if v.dtype == torch.float8_e4m3fn)
    print(f"  deepseek_v3_fp8: {len(fp8)} FP8 weights ({fp8[0]}, ...); logits max |.| %.3f" % np.abs(logits).max())


EXTRA = {"mxfp4": build_mxfp4, "fp8": build_fp8}


def main(argv):
    names = argv or [*CASES, *EXTRA]
    unknown = [n for n in names if n not in CASES and n not in EXTRA]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; cases: {[*CASES, *EXTRA]}")
    for name in names:
        print(f"=== {name}")
        EXTRA[name]() if name in EXTRA else build(name)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
