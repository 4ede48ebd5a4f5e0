"""Healthy-architecture sweep: no finding on real ``transformers`` models that train normally.

Each architecture is built from a small config with random weights (nothing is downloaded),
put in training mode and trained for 3 AdamW steps (lr 1e-4) with ``hs.Monitor(model,
every=1)`` attached. A freshly initialised model of a published architecture, trained at a
usual learning rate, is healthy: any finding on it is a false alarm.

The configs are shrunk (1-2 layers, widths 16-64, vocabulary 128, 32-pixel images, 0.1 s of
audio) but otherwise left at the library's defaults, initialisation included. Where a default is
genuinely unhealthy (MobileNet-V1's classifier dropout of 0.999, EfficientNet's BatchNorm scales
near 0) or unhealthy only because of the shrinking (1x1 feature maps), it is fixed here and a
comment says why. An architecture is skipped only when its class is missing from the installed
``transformers``; never to hide a finding.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import hookscope as hs

pytestmark = pytest.mark.slow

V = 128  # vocabulary size
LABELS = 3  # classes for every classification head
STEPS = 3


# -- the architectures -----------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """One architecture: a ``transformers`` model class, its config, and the batch it trains on.

    ``inputs`` is one of ``"lm"`` (causal LM, labels = input ids), ``"cls"`` (sequence
    classification), ``"s2s"`` (encoder-decoder with decoder labels), ``"image"``,
    ``"wave"`` (raw audio), ``"mel"`` (Whisper's log-mel frames), ``"frames"`` (``(batch,
    time, features)`` speech features) or ``"spectrogram"`` (AST's ``(batch, time, mel)``).
    ``fix``, when given, repairs the freshly initialised model (see its docstring).
    """

    id: str
    model: str
    inputs: str
    config: dict[str, Any] = field(default_factory=dict)
    fix: Callable[[nn.Module], None] | None = None


def unit_batchnorm_scales(model: nn.Module) -> None:
    """EfficientNet's ``_init_weights`` draws BatchNorm scales from N(0, 0.02) like a Linear's
    weights: every BatchNorm multiplies its output by ~0.02, activations fall to 1e-24 within
    seven blocks and the gradient below them is exactly zero (a true vanishing gradient, at any
    size). The paper's reference code (and torchvision's) starts BatchNorm scales at 1."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            nn.init.ones_(module.weight)


# Shared shapes, copied per architecture (``dict(BERT, ...)``).
BERT = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
LLAMA = dict(BERT, num_key_value_heads=1, head_dim=16)
BART = dict(
    vocab_size=V,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
)
T5 = dict(
    vocab_size=V,
    d_model=32,
    d_kv=16,
    d_ff=64,
    num_layers=1,
    num_decoder_layers=1,
    num_heads=2,
    relative_attention_num_buckets=8,
    decoder_start_token_id=0,
)
VIT = dict(
    image_size=32,
    patch_size=8,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
)
CNN = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
WAVE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 4),
    conv_kernel=(10, 8),
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=2,
    classifier_proj_size=16,
)
MOE = dict(num_experts=4, num_experts_per_tok=2)
SPECIAL_TOKENS = dict(
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
    cls_token_id=1,
    sep_token_id=2,
    mask_token_id=3,
)

ARCHS = [
    # -- decoders: causal language models ------------------------------------------------
    Arch(
        "gpt2",
        "GPT2LMHeadModel",
        "lm",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64),
    ),
    Arch(
        "gpt_neo",
        "GPTNeoForCausalLM",
        "lm",
        dict(
            vocab_size=V,
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
        ),
    ),
    Arch(
        "gptj",
        "GPTJForCausalLM",
        "lm",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64, rotary_dim=8),
    ),
    Arch(
        "opt",
        "OPTForCausalLM",
        "lm",
        dict(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=64,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
    ),
    Arch("llama", "LlamaForCausalLM", "lm", LLAMA),
    Arch("mistral", "MistralForCausalLM", "lm", LLAMA),
    Arch("mixtral", "MixtralForCausalLM", "lm", dict(LLAMA, num_local_experts=4)),
    Arch("qwen2", "Qwen2ForCausalLM", "lm", LLAMA),
    Arch(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "lm",
        dict(LLAMA, **MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    ),
    Arch("qwen3", "Qwen3ForCausalLM", "lm", LLAMA),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", "lm", dict(LLAMA, **MOE, moe_intermediate_size=32)),
    Arch("gemma", "GemmaForCausalLM", "lm", LLAMA),
    Arch("gemma2", "Gemma2ForCausalLM", "lm", dict(LLAMA, sliding_window=8)),
    Arch("gemma3", "Gemma3ForCausalLM", "lm", dict(LLAMA, sliding_window=8)),
    Arch("phi", "PhiForCausalLM", "lm", dict(LLAMA, num_key_value_heads=2)),
    Arch("phi3", "Phi3ForCausalLM", "lm", dict(LLAMA, pad_token_id=0)),
    Arch(
        "falcon",
        "FalconForCausalLM",
        "lm",
        dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2),
    ),
    Arch(
        "bloom", "BloomForCausalLM", "lm", dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=2)
    ),
    Arch(
        "mpt",
        "MptForCausalLM",
        "lm",
        dict(vocab_size=V, d_model=32, n_heads=2, n_layers=2, expansion_ratio=2, max_seq_len=64),
    ),
    Arch(
        "codegen",
        "CodeGenForCausalLM",
        "lm",
        # CodeGen splits its fused qkv projection into 4 (mp_num), so heads come in fours.
        dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_ctx=64, rotary_dim=8),
    ),
    Arch("gpt_neox", "GPTNeoXForCausalLM", "lm", BERT),
    Arch(
        "gpt_bigcode",
        "GPTBigCodeForCausalLM",
        "lm",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64),
    ),
    Arch(
        "rwkv",
        "RwkvForCausalLM",
        "lm",
        dict(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            attention_hidden_size=32,
            intermediate_size=64,
            context_length=64,
        ),
    ),
    Arch(
        "mamba",
        "MambaForCausalLM",
        "lm",
        dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2),
    ),
    Arch(
        "mamba2",
        "Mamba2ForCausalLM",
        "lm",
        dict(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=16,
            state_size=8,
            n_groups=1,
            expand=2,
            chunk_size=8,
        ),
    ),
    Arch(
        "falcon_mamba",
        "FalconMambaForCausalLM",
        "lm",
        dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2),
    ),
    Arch("stablelm", "StableLmForCausalLM", "lm", dict(LLAMA, num_key_value_heads=2)),
    Arch("olmo", "OlmoForCausalLM", "lm", LLAMA),
    Arch("olmo2", "Olmo2ForCausalLM", "lm", LLAMA),
    Arch("olmoe", "OlmoeForCausalLM", "lm", dict(LLAMA, **MOE)),
    Arch("cohere", "CohereForCausalLM", "lm", LLAMA),
    Arch("starcoder2", "Starcoder2ForCausalLM", "lm", LLAMA),
    Arch("persimmon", "PersimmonForCausalLM", "lm", BERT),
    Arch("granite", "GraniteForCausalLM", "lm", LLAMA),
    Arch("nemotron", "NemotronForCausalLM", "lm", LLAMA),
    Arch("helium", "HeliumForCausalLM", "lm", LLAMA),
    Arch("glm", "GlmForCausalLM", "lm", LLAMA),
    Arch("smollm3", "SmolLM3ForCausalLM", "lm", LLAMA),
    Arch(
        "xglm",
        "XGLMForCausalLM",
        "lm",
        dict(
            vocab_size=V,
            d_model=32,
            num_layers=2,
            attention_heads=2,
            ffn_dim=64,
            max_position_embeddings=64,
        ),
    ),
    Arch("biogpt", "BioGptForCausalLM", "lm", BERT),
    Arch(
        "ctrl",
        "CTRLLMHeadModel",
        "lm",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=2, dff=64, n_positions=64),
    ),
    Arch(
        "openai_gpt",
        "OpenAIGPTLMHeadModel",
        "lm",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64),
    ),
    Arch(
        "xlnet",
        "XLNetLMHeadModel",
        "lm",
        dict(vocab_size=V, d_model=32, n_layer=2, n_head=2, d_inner=64),
    ),
    # -- encoders: sequence classification -----------------------------------------------
    Arch("bert", "BertForSequenceClassification", "cls", BERT),
    Arch("roberta", "RobertaForSequenceClassification", "cls", BERT),
    Arch("xlm_roberta", "XLMRobertaForSequenceClassification", "cls", BERT),
    Arch("camembert", "CamembertForSequenceClassification", "cls", BERT),
    Arch("data2vec_text", "Data2VecTextForSequenceClassification", "cls", BERT),
    Arch("ernie", "ErnieForSequenceClassification", "cls", BERT),
    Arch("roberta_prelayernorm", "RobertaPreLayerNormForSequenceClassification", "cls", BERT),
    Arch("megatron_bert", "MegatronBertForSequenceClassification", "cls", BERT),
    Arch("roformer", "RoFormerForSequenceClassification", "cls", BERT),
    Arch("ibert", "IBertForSequenceClassification", "cls", BERT),
    Arch(
        "distilbert",
        "DistilBertForSequenceClassification",
        "cls",
        dict(
            vocab_size=V, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
        ),
    ),
    Arch("albert", "AlbertForSequenceClassification", "cls", dict(BERT, embedding_size=16)),
    Arch("electra", "ElectraForSequenceClassification", "cls", dict(BERT, embedding_size=16)),
    Arch("deberta", "DebertaForSequenceClassification", "cls", BERT),
    Arch("deberta_v2", "DebertaV2ForSequenceClassification", "cls", BERT),
    Arch("mpnet", "MPNetForSequenceClassification", "cls", BERT),
    Arch(
        "modernbert",
        "ModernBertForSequenceClassification",
        "cls",
        dict(BERT, local_attention=8, global_attn_every_n_layers=2),
    ),
    Arch("convbert", "ConvBertForSequenceClassification", "cls", dict(BERT, embedding_size=32)),
    Arch(
        "squeezebert",
        "SqueezeBertForSequenceClassification",
        "cls",
        dict(BERT, embedding_size=32),
    ),
    # MobileBERT's default NoNorm (an elementwise affine map, no normalisation) keeps the
    # 0.02-std embeddings' scale: queries and keys come out ~3e-4, attention logits ~1e-7, and
    # the query/key gradients (7e-14 here, 4e-9 at the default size) are far below Adam's eps,
    # so they do not train: a true vanishing gradient, also at full size. (MobileBERT is
    # trained by layer-wise distillation from a teacher, not from this init.) LayerNorm is its
    # other published normalisation.
    Arch(
        "mobilebert",
        "MobileBertForSequenceClassification",
        "cls",
        dict(
            BERT,
            normalization_type="layer_norm",
            embedding_size=16,
            intra_bottleneck_size=16,
            true_hidden_size=16,
            num_feedforward_networks=1,
        ),
    ),
    Arch(
        "rembert",
        "RemBertForSequenceClassification",
        "cls",
        dict(BERT, input_embedding_size=16, output_embedding_size=16),
    ),
    Arch(
        "funnel",
        "FunnelForSequenceClassification",
        "cls",
        dict(
            vocab_size=V,
            block_sizes=[1, 1],
            num_decoder_layers=1,
            d_model=32,
            n_head=2,
            d_head=16,
            d_inner=64,
        ),
    ),
    Arch(
        "big_bird",
        "BigBirdForSequenceClassification",
        "cls",
        dict(BERT, attention_type="original_full"),
    ),
    Arch(
        "longformer", "LongformerForSequenceClassification", "cls", dict(BERT, attention_window=8)
    ),
    Arch(
        "nystromformer",
        "NystromformerForSequenceClassification",
        "cls",
        dict(BERT, num_landmarks=4, segment_means_seq_len=16),
    ),
    Arch("yoso", "YosoForSequenceClassification", "cls", BERT),
    Arch("fnet", "FNetForSequenceClassification", "cls", BERT),
    Arch("xmod", "XmodForSequenceClassification", "cls", dict(BERT, default_language="en_XX")),
    Arch("esm", "EsmForSequenceClassification", "cls", dict(BERT, pad_token_id=1)),
    Arch("layoutlm", "LayoutLMForSequenceClassification", "cls", BERT),
    Arch(
        "xlm",
        "XLMForSequenceClassification",
        "cls",
        dict(vocab_size=V, emb_dim=32, n_layers=2, n_heads=2, max_position_embeddings=64),
    ),
    # -- encoder-decoders ------------------------------------------------------------------
    Arch("t5", "T5ForConditionalGeneration", "s2s", T5),
    Arch("mt5", "MT5ForConditionalGeneration", "s2s", T5),
    Arch("umt5", "UMT5ForConditionalGeneration", "s2s", T5),
    Arch("longt5", "LongT5ForConditionalGeneration", "s2s", dict(T5, local_radius=4)),
    Arch(
        "switch_transformers",
        "SwitchTransformersForConditionalGeneration",
        "s2s",
        dict(T5, num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    ),
    Arch("bart", "BartForConditionalGeneration", "s2s", BART),
    Arch("mbart", "MBartForConditionalGeneration", "s2s", BART),
    Arch("pegasus", "PegasusForConditionalGeneration", "s2s", BART),
    # Marian's defaults name token 58100 (its real vocabulary's pad) as pad and decoder start.
    Arch(
        "marian",
        "MarianMTModel",
        "s2s",
        dict(BART, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1),
    ),
    Arch("blenderbot", "BlenderbotForConditionalGeneration", "s2s", BART),
    Arch("blenderbot_small", "BlenderbotSmallForConditionalGeneration", "s2s", BART),
    Arch("plbart", "PLBartForConditionalGeneration", "s2s", BART),
    Arch("m2m_100", "M2M100ForConditionalGeneration", "s2s", BART),
    Arch("mvp", "MvpForConditionalGeneration", "s2s", BART),
    Arch(
        "led",
        "LEDForConditionalGeneration",
        "s2s",
        dict(
            BART,
            max_encoder_position_embeddings=64,
            max_decoder_position_embeddings=64,
            attention_window=8,
        ),
    ),
    Arch(
        "bigbird_pegasus",
        "BigBirdPegasusForConditionalGeneration",
        "s2s",
        dict(BART, attention_type="original_full"),
    ),
    Arch(
        "pegasus_x",
        "PegasusXForConditionalGeneration",
        "s2s",
        dict(BART, block_size=8, num_global_tokens=4),
    ),
    Arch(
        "prophetnet",
        "ProphetNetForConditionalGeneration",
        "s2s",
        dict(
            vocab_size=V,
            hidden_size=32,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_encoder_layers=1,
            num_decoder_layers=1,
            num_encoder_attention_heads=2,
            num_decoder_attention_heads=2,
            max_position_embeddings=64,
            ngram=2,
            num_buckets=8,
        ),
    ),
    # -- vision: image classification ------------------------------------------------------
    Arch("vit", "ViTForImageClassification", "image", VIT),
    Arch("deit", "DeiTForImageClassification", "image", VIT),
    Arch("beit", "BeitForImageClassification", "image", VIT),
    Arch("data2vec_vision", "Data2VecVisionForImageClassification", "image", VIT),
    Arch("vit_msn", "ViTMSNForImageClassification", "image", VIT),
    Arch("ijepa", "IJepaForImageClassification", "image", VIT),
    Arch("dinov2", "Dinov2ForImageClassification", "image", VIT),
    Arch(
        "dinov2_with_registers",
        "Dinov2WithRegistersForImageClassification",
        "image",
        dict(VIT, num_register_tokens=4),
    ),
    Arch(
        "swin",
        "SwinForImageClassification",
        "image",
        dict(
            image_size=32,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
        ),
    ),
    Arch(
        "swinv2",
        "Swinv2ForImageClassification",
        "image",
        dict(
            image_size=32,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
        ),
    ),
    Arch(
        "focalnet",
        "FocalNetForImageClassification",
        "image",
        dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1]),
    ),
    Arch("convnext", "ConvNextForImageClassification", "image", dict(CNN, num_stages=2)),
    Arch("convnextv2", "ConvNextV2ForImageClassification", "image", dict(CNN, num_stages=2)),
    Arch("resnet", "ResNetForImageClassification", "image", dict(CNN, layer_type="basic")),
    Arch(
        "resnet_bottleneck",
        "ResNetForImageClassification",
        "image",
        dict(CNN, layer_type="bottleneck"),
    ),
    Arch("regnet", "RegNetForImageClassification", "image", dict(CNN, groups_width=8)),
    # BiT's GroupNorms default to 32 groups, more than the tiny widths here (8 to 32) have.
    Arch("bit", "BitForImageClassification", "image", dict(CNN, num_groups=4)),
    # The MobileNets downsample 32x: at 32 pixels their last blocks would see 1x1 maps, and
    # their BatchNorms would normalise over 4 values (the batch) per channel, a backward gain
    # no real input size gives; 64 pixels leaves 2x2 maps (16 values).
    # MobileNet-V1's config takes TF-Slim's *keep* probability 0.999 as the dropout
    # probability: the head sees one unit in a thousand, scaled by 1000. The paper drops 0.001.
    Arch(
        "mobilenet_v1",
        "MobileNetV1ForImageClassification",
        "image",
        dict(image_size=64, depth_multiplier=0.25, classifier_dropout_prob=0.001),
    ),
    Arch(
        "mobilenet_v2",
        "MobileNetV2ForImageClassification",
        "image",
        dict(image_size=64, depth_multiplier=0.25),
    ),
    Arch(
        "efficientnet",
        "EfficientNetForImageClassification",
        "image",
        # hidden_dim is the top convolution's width: round_filters(1280) at width 0.25; 64
        # pixels for the same reason as the MobileNets (EfficientNet also downsamples 32x).
        dict(image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),
        fix=unit_batchnorm_scales,
    ),
    Arch(
        "poolformer",
        "PoolFormerForImageClassification",
        "image",
        dict(
            num_encoder_blocks=2,
            depths=[1, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            padding=[2, 1],
            mlp_ratio=2.0,
        ),
    ),
    Arch(
        "pvt",
        "PvtForImageClassification",
        "image",
        dict(
            image_size=32,
            num_encoder_blocks=2,
            depths=[1, 1],
            sequence_reduction_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[4, 2],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
        ),
    ),
    Arch(
        "pvt_v2",
        "PvtV2ForImageClassification",
        "image",
        dict(
            image_size=32,
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
        ),
    ),
    Arch(
        "segformer",
        "SegformerForImageClassification",
        "image",
        dict(
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            decoder_hidden_size=32,
        ),
    ),
    Arch(
        "cvt",
        "CvtForImageClassification",
        "image",
        # CvtStage indexes its drop-path rates by stage number: stage i needs depth > i.
        dict(embed_dim=[16, 24, 32], num_heads=[1, 2, 2], depth=[1, 2, 3]),
    ),
    Arch(
        "levit",
        "LevitForImageClassification",
        "image",
        dict(
            # 16x patch embedding, then two 2x subsamplings: at 64 pixels the last stage
            # would have a single token, whose attention bias gets exactly zero gradient.
            image_size=128,
            hidden_sizes=[32, 48, 64],
            num_attention_heads=[2, 2, 2],
            depths=[1, 1, 1],
            key_dim=[8, 8, 8],
        ),
    ),
    # -- audio ---------------------------------------------------------------------------
    Arch("wav2vec2", "Wav2Vec2ForSequenceClassification", "wave", WAVE),
    Arch("hubert", "HubertForSequenceClassification", "wave", WAVE),
    Arch("wavlm", "WavLMForSequenceClassification", "wave", dict(WAVE, num_buckets=16)),
    Arch("unispeech", "UniSpeechForSequenceClassification", "wave", WAVE),
    Arch("unispeech_sat", "UniSpeechSatForSequenceClassification", "wave", WAVE),
    Arch("data2vec_audio", "Data2VecAudioForSequenceClassification", "wave", WAVE),
    Arch("sew", "SEWForSequenceClassification", "wave", dict(WAVE, squeeze_factor=2)),
    Arch(
        "wav2vec2_conformer",
        "Wav2Vec2ConformerForSequenceClassification",
        "wave",
        dict(WAVE, conv_depthwise_kernel_size=3),
    ),
    # Whisper's defaults name its real vocabulary's special tokens (50256...).
    Arch(
        "whisper",
        "WhisperForConditionalGeneration",
        "mel",
        dict(
            BART,
            num_mel_bins=16,
            max_source_positions=16,
            max_target_positions=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
    ),
    Arch(
        "speech_to_text",
        "Speech2TextForConditionalGeneration",
        "frames",
        dict(
            BART,
            input_feat_per_channel=16,
            conv_channels=16,
            max_source_positions=64,
            max_target_positions=64,
        ),
    ),
    Arch(
        "audio_spectrogram_transformer",
        "ASTForAudioClassification",
        "spectrogram",
        dict(VIT, patch_size=16, frequency_stride=8, time_stride=8, max_length=64, num_mel_bins=32),
    ),
]


# -- building and training ---------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads; on busy cores they lose 10-30x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(arch: Arch) -> nn.Module:
    """The model with random weights, or a skip when this ``transformers`` lacks the class."""
    cls = getattr(transformers, arch.model, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {arch.model}")
    config = cls.config_class(**arch.config)
    # Defaults name the real vocabulary's special tokens (GPT-2's 50256, ModernBERT's 50283...):
    # move them into the small one.
    for name, small in SPECIAL_TOKENS.items():
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= V:
            setattr(config, name, small)
    if arch.inputs in ("cls", "image", "wave", "spectrogram"):
        config.num_labels = LABELS
    model = cls(config)
    if arch.fix is not None:
        with torch.no_grad():
            arch.fix(model)
    return model


def batch(arch: Arch, config: Any) -> dict[str, torch.Tensor]:
    """A batch with labels, so that ``model(**batch).loss`` is the training loss."""
    labels = torch.randint(0, LABELS, (4,))
    ids = torch.randint(4, V, (2, 16))  # ids 0-3 are left to the special tokens
    if arch.inputs == "lm":
        return dict(input_ids=ids, labels=ids)
    if arch.inputs == "cls":
        return dict(input_ids=ids, labels=labels[:2])
    if arch.inputs == "s2s":
        return dict(input_ids=ids, labels=torch.randint(4, V, (2, 8)))
    if arch.inputs == "image":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (tuple, list)) else size
        return dict(pixel_values=torch.randn(4, 3, size, size), labels=labels)
    if arch.inputs == "wave":
        return dict(input_values=torch.randn(2, 1600), labels=labels[:2])
    if arch.inputs == "mel":
        frames = 2 * config.max_source_positions
        return dict(
            input_features=torch.randn(2, config.num_mel_bins, frames),
            labels=torch.randint(4, V, (2, 8)),
        )
    if arch.inputs == "frames":
        return dict(
            input_features=torch.randn(2, 32, config.input_feat_per_channel),
            labels=torch.randint(4, V, (2, 8)),
        )
    if arch.inputs == "spectrogram":
        return dict(
            input_values=torch.randn(2, config.max_length, config.num_mel_bins),
            labels=labels[:2],
        )
    raise AssertionError(arch.inputs)


def train(model: nn.Module, make_batch: Callable[[], dict[str, torch.Tensor]]) -> list[Any]:
    """3 AdamW steps at lr 1e-4 under ``hs.Monitor(model, every=1)``; the findings."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with hs.Monitor(model, every=1) as mon:
        for _ in range(STEPS):
            loss = model(**make_batch()).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss)
    return mon.findings


def describe(findings: list[Any]) -> str:
    return "\n".join(
        f"  {f.kind} at {f.module!r} (step {f.step}, value {f.value:.4g}): {f.message}"
        for f in findings
    )


@pytest.mark.parametrize("arch", ARCHS, ids=[a.id for a in ARCHS])
def test_healthy_architecture_has_no_finding(arch: Arch) -> None:
    torch.manual_seed(0)
    model = build(arch)
    start = time.perf_counter()
    findings = train(model, lambda: batch(arch, model.config))
    elapsed = time.perf_counter() - start
    assert findings == [], (
        f"{arch.id} ({arch.model}, {elapsed:.1f} s): {len(findings)} finding(s) on a healthy "
        f"model:\n{describe(findings)}"
    )


def test_the_sweep_is_wide() -> None:
    ids = [a.id for a in ARCHS]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 60
