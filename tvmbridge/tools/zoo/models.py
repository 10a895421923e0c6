"""The zoo's registry: tiny random-weight models of many architectures and the batches users pass them.

Nothing is downloaded: every model is built from a ``transformers`` config or by
``timm.create_model(..., pretrained=False)``, small enough (hidden 32, 2 layers, 32x32 images)
that a compile takes seconds, with dropout on, so that what is tested is the architecture's
graph (its ops, masks, losses, RNG), not its size. Each batch is what a training loop passes
(``model(**batch)``): every input a tokenizer or feature extractor gives (padding in the last
row), and the labels, so that the model computes its own loss. timm models take pixels only:
their entries are marked ``external_loss`` and the harness takes the cross-entropy of the logits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .batches import (
    IMAGE,
    NUM_LABELS,
    VOCAB,
    Batch,
    BatchMaker,
    clm_batch,
    cls_batch,
    ctc_batch,
    image_batch,
    image_text_batch,
    mlm_batch,
    pixel_batch,
    rtd_batch,
    seq2seq_batch,
    whisper_batch,
)
from .handwritten import NanoGPT, TransformerTranslator, WordLSTM, nanogpt_batch, translation_batch

FAMILIES = ("text-encoder", "decoder", "enc-dec", "vision", "cnn", "audio", "timm", "torchvision")
# timm's CNNs downsample 32x: at 32x32 their last BatchNorms normalize 2 values (1x1 maps, batch 2) to +-1,
# a float32 gradient of noise times 1/|x1-x2|, further from float64 than its size. 64x64 keeps 2x2.
CNN_IMAGE = 64


@dataclass(frozen=True)
class ZooEntry:
    """One architecture: how to build it, and ``make_batch(batch_size, length, seed)``."""

    name: str
    family: str
    build: Callable[[], torch.nn.Module]
    make_batch: BatchMaker
    external_loss: bool = False  # the model returns logits only: the loss is cross-entropy of them
    note: str = ""
    # applied to the float64 reference copy only, where the model's default kernel has no float64
    prepare_reference: Callable[[Any], object] | None = None  # gets the library's model (its own methods)

    def forward(self, model: torch.nn.Module, batch: Batch) -> tuple[Any, torch.Tensor]:
        """The output and the loss of one call, as a training loop gets them."""
        if self.external_loss:
            out = model(batch["x"])
            return out, F.cross_entropy(out, batch["labels"])
        out = model(**batch)
        return out, out.loss


# --- imports: the torchvision on disk may be a CUDA build next to CPU torch ---------------------
def ensure_torchvision() -> None:
    """Import torchvision (timm and transformers' vision models need it). A torchvision whose C
    extension does not load next to this torch (a CUDA wheel beside CPU torch) fails on import
    while registering a fake kernel for ``torchvision::nms``; defining the two op schemas first
    lets the pure-Python part (all that these models use) import."""
    try:
        import torchvision  # noqa: F401
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[key]
        for op in ("nms", "qnms"):
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision  # noqa: F401


def hf(model_cls: str, config_cls: str, **config: Any) -> Callable[[], torch.nn.Module]:
    """A builder of ``transformers.<model_cls>(<config_cls>(**config))``."""

    def build() -> torch.nn.Module:
        ensure_torchvision()
        import transformers

        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))

    build.__qualname__ = f"{model_cls}"
    return build


def timm_model(name: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    """A builder of ``timm.create_model(name)`` with random weights and 10 classes."""

    def build() -> torch.nn.Module:
        ensure_torchvision()
        import timm

        return timm.create_model(name, pretrained=False, num_classes=NUM_LABELS, **kwargs)

    build.__qualname__ = f"timm.{name}"
    return build


# --- batches ----------------------------------------------------------------------------------
ENC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
)
DEC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attention_dropout=0.1,
)
VIT = dict(
    image_size=IMAGE,
    patch_size=8,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    num_labels=NUM_LABELS,
)
TINY_VIT = dict(
    image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
)  # no classification head's options (MAE, CLIP's vision tower)
ROBERTA = dict(ENC, max_position_embeddings=130, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
S2S = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
)
TIMM_DROP = dict(drop_rate=0.1, drop_path_rate=0.1)


def _text_encoders() -> list[ZooEntry]:
    """Encoders with a masked-LM, classification or detection head."""
    E = ZooEntry
    # fmt: off
    text = [
        E("bert-mlm", "text-encoder", hf("BertForMaskedLM", "BertConfig", **ENC), mlm_batch()),
        E("bert-cls", "text-encoder", hf("BertForSequenceClassification", "BertConfig", **ENC, num_labels=3),
          cls_batch()),
        E("roberta-mlm", "text-encoder", hf("RobertaForMaskedLM", "RobertaConfig", **ROBERTA),
          mlm_batch(pad=1, token_types=False)),
        E("roformer-mlm", "text-encoder", hf("RoFormerForMaskedLM", "RoFormerConfig", **ENC), mlm_batch()),
        E("xlm-roberta-mlm", "text-encoder", hf("XLMRobertaForMaskedLM", "XLMRobertaConfig", **ROBERTA),
          mlm_batch(pad=1, token_types=False)),
        E("distilbert-mlm", "text-encoder",
          hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
             hidden_dim=64, max_position_embeddings=128), mlm_batch(token_types=False)),
        E("albert-mlm", "text-encoder",
          hf("AlbertForMaskedLM", "AlbertConfig", **ENC, embedding_size=16, hidden_dropout_prob=0.1,
             attention_probs_dropout_prob=0.1), mlm_batch()),
        E("electra-rtd", "text-encoder", hf("ElectraForPreTraining", "ElectraConfig", **ENC, embedding_size=16),
          rtd_batch()),
        E("deberta-v2-mlm", "text-encoder",
          hf("DebertaV2ForMaskedLM", "DebertaV2Config", **ENC, relative_attention=True, position_buckets=16,
             pos_att_type=["p2c", "c2p"], max_relative_positions=-1), mlm_batch()),
        E("mpnet-mlm", "text-encoder", hf("MPNetForMaskedLM", "MPNetConfig", **dict(ROBERTA, type_vocab_size=None)),
          mlm_batch(pad=1, token_types=False)),
        E("convbert-mlm", "text-encoder", hf("ConvBertForMaskedLM", "ConvBertConfig", **ENC, embedding_size=32),
          mlm_batch(), note="span-based dynamic convolution: x[..., i, j] with two index tensors"),
        E("modernbert-mlm", "text-encoder",
          hf("ModernBertForMaskedLM", "ModernBertConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128, pad_token_id=0,
             attention_dropout=0.1, mlp_dropout=0.1, embedding_dropout=0.1, local_attention=8,
             bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
          mlm_batch(token_types=False)),
        E("canine-cls", "text-encoder",
          hf("CanineForSequenceClassification", "CanineConfig", hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=64, num_hash_functions=4, num_hash_buckets=64,
             downsampling_rate=4, max_position_embeddings=256, num_labels=3), cls_batch(),
          note="its final character encoder's dropouts feed nothing the classifier reads: drawn all the same"),
        E("esm-mlm", "text-encoder", hf("EsmForMaskedLM", "EsmConfig", **ENC, position_embedding_type="rotary",
                                        pad_token_id=0, mask_token_id=3, token_dropout=True),
          mlm_batch(token_types=False), note="token dropout: embeddings rescaled by each row's masked fraction"),
        E("xlm-mlm", "text-encoder", hf("XLMWithLMHeadModel", "XLMConfig", vocab_size=VOCAB, emb_dim=32, n_layers=2,
          n_heads=4), mlm_batch(token_types=False), note="asserts lengths.max().item() <= slen, slices x[:, -n:]"),
        E("mobilebert-mlm", "text-encoder",
          hf("MobileBertForMaskedLM", "MobileBertConfig", **ENC, embedding_size=16, intra_bottleneck_size=16,
             true_hidden_size=16, num_feedforward_networks=2), mlm_batch()),
    ]
    # fmt: on
    return text


def _decoders() -> list[ZooEntry]:
    """Decoder LLMs (causal LM loss from the shifted ids)."""
    E = ZooEntry
    clm = clm_batch()
    # fmt: off
    decoders = [
        E("llama", "decoder", hf("LlamaForCausalLM", "LlamaConfig", **DEC), clm),
        E("mistral", "decoder", hf("MistralForCausalLM", "MistralConfig", **DEC), clm),
        E("qwen2", "decoder", hf("Qwen2ForCausalLM", "Qwen2Config", **DEC), clm),
        E("qwen3", "decoder", hf("Qwen3ForCausalLM", "Qwen3Config", **DEC, head_dim=8), clm),
        E("phi", "decoder", hf("PhiForCausalLM", "PhiConfig", **DEC, resid_pdrop=0.1, embd_pdrop=0.1,
                               partial_rotary_factor=0.5), clm),
        E("phi3", "decoder", hf("Phi3ForCausalLM", "Phi3Config", **DEC, resid_pdrop=0.1, embd_pdrop=0.1,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2), clm),
        E("gemma", "decoder", hf("GemmaForCausalLM", "GemmaConfig", **DEC, head_dim=8), clm),
        E("gemma2", "decoder", hf("Gemma2ForCausalLM", "Gemma2Config", **DEC, head_dim=8, query_pre_attn_scalar=8,
                                  sliding_window=8), clm),
        E("gpt2", "decoder", hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                n_positions=128, bos_token_id=0, eos_token_id=0), clm),
        E("gpt2-cls", "decoder", hf("GPT2ForSequenceClassification", "GPT2Config", vocab_size=VOCAB, n_embd=32,
                                    n_layer=2, n_head=4, n_positions=128, pad_token_id=0, num_labels=3),
          cls_batch(token_types=False), note="the last real token's logits: logits[arange(b), last]"),
        E("gpt-neo", "decoder",
          hf("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
             intermediate_size=64, attention_types=[[["global", "local"], 1]], window_size=8,
             max_position_embeddings=128, embed_dropout=0.1, attention_dropout=0.1, resid_dropout=0.1,
             bos_token_id=0, eos_token_id=0), clm),
        E("gpt-neox", "decoder",
          hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **DEC, hidden_dropout=0.1, rotary_pct=0.25), clm),
        E("opt", "decoder",
          hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32,
             pad_token_id=1, bos_token_id=2, eos_token_id=2), clm_batch(pad=1)),
        E("bloom", "decoder",
          hf("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
             hidden_dropout=0.1, attention_dropout=0.1), clm),
        E("falcon", "decoder",
          hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1), clm),
        E("gptj", "decoder", hf("GPTJForCausalLM", "GPTJConfig", **DEC, rotary_dim=4, n_positions=128), clm),
        E("mamba", "decoder", hf("MambaForCausalLM", "MambaConfig", **DEC, state_size=4), clm,
          note="a selective scan: a loop over the sequence, unrolled by the trace"),
        E("stablelm", "decoder",
          hf("StableLmForCausalLM", "StableLmConfig", **DEC, hidden_dropout=0.1, partial_rotary_factor=0.25), clm),
        E("mixtral", "decoder",
          hf("MixtralForCausalLM", "MixtralConfig", **DEC, num_local_experts=4, num_experts_per_tok=2), clm,
          prepare_reference=lambda m: m.set_experts_implementation("eager"),
          note="the float64 reference runs the experts eagerly (grouped_mm has no float64)"),
        E("olmoe", "decoder", hf("OlmoeForCausalLM", "OlmoeConfig", **DEC, num_experts=4, num_experts_per_tok=2), clm,
          prepare_reference=lambda m: m.set_experts_implementation("eager"),
          note="experts routed by sort, histc and grouped products (all experts' products, each row's kept)"),
        E("qwen2-moe", "decoder",
          hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **DEC, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32), clm,
          prepare_reference=lambda m: m.set_experts_implementation("eager"), note="routed experts and a shared one"),
        E("gemma3", "decoder", hf("Gemma3ForCausalLM", "Gemma3TextConfig", **DEC, head_dim=8), clm),
        E("lfm2", "decoder", hf("Lfm2ForCausalLM", "Lfm2Config", **DEC), clm,
          note="short causal convolutions between attention layers"),
    ]
    # fmt: on
    return decoders


def _decoder_variants() -> list[ZooEntry]:
    """Decoders that vary the common form: multi-query attention, scaled embeddings, residuals and
    logits, parallel blocks, two-stream relative attention."""
    E = ZooEntry
    clm = clm_batch()
    # fmt: off
    return [
        E("gpt-bigcode", "decoder", hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_embd=32,
                                       n_layer=2, n_head=4, n_positions=128, multi_query=True), clm,
          note="multi-query attention"),
        E("granite", "decoder", hf("GraniteForCausalLM", "GraniteConfig", **DEC, embedding_multiplier=2.0,
                                   logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.1), clm),
        E("cohere", "decoder", hf("CohereForCausalLM", "CohereConfig", **DEC), clm),
        E("xlnet-lm", "decoder", hf("XLNetLMHeadModel", "XLNetConfig", vocab_size=VOCAB, d_model=32, n_layer=2,
                                    n_head=4, d_inner=64), clm, note="two-stream relative attention"),
    ]
    # fmt: on


def _handwritten() -> list[ZooEntry]:
    """Models written by hand as users write them (``handwritten``), not from a library."""
    return [
        ZooEntry("nanogpt", "decoder", NanoGPT, nanogpt_batch(),
                 note="nanoGPT's model.py: fused attention at dropout 0, its output view()ed"),
        ZooEntry("nn-transformer", "enc-dec", TransformerTranslator, translation_batch(),
                 note="PyTorch's nn.Transformer with a causal tgt_mask and padding masks"),
        ZooEntry("word-lstm", "decoder", WordLSTM, nanogpt_batch(),
                 note="PyTorch's word_language_model: a 2-layer nn.LSTM with dropout, tied decoder"),
    ]  # fmt: skip


def _encoder_decoders() -> list[ZooEntry]:
    """Encoder-decoders (labels through the decoder)."""
    E = ZooEntry
    # fmt: off
    encdec = [
        E("t5", "enc-dec", hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8,
                              d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                              pad_token_id=0, decoder_start_token_id=0), seq2seq_batch()),
        E("bart", "enc-dec", hf("BartForConditionalGeneration", "BartConfig", **S2S, pad_token_id=1,
                                bos_token_id=0, eos_token_id=2, decoder_start_token_id=2), seq2seq_batch(pad=1)),
        E("pegasus", "enc-dec", hf("PegasusForConditionalGeneration", "PegasusConfig", **S2S, pad_token_id=0,
                                   eos_token_id=1, decoder_start_token_id=0), seq2seq_batch()),
        E("marian", "enc-dec", hf("MarianMTModel", "MarianConfig", **S2S, pad_token_id=0, eos_token_id=1,
                                  decoder_start_token_id=0, decoder_vocab_size=VOCAB), seq2seq_batch()),
        # local attention: its block masks compare and add booleans (`mask > 0`)
        E("longt5", "enc-dec", hf("LongT5ForConditionalGeneration", "LongT5Config", vocab_size=VOCAB, d_model=32,
                                  d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                  local_radius=4, pad_token_id=0, decoder_start_token_id=0), seq2seq_batch()),
    ]
    # fmt: on
    return encdec


def _vision() -> list[ZooEntry]:
    """Vision transformers and CNNs from transformers."""
    E = ZooEntry
    img = image_batch()
    # fmt: off
    vision = [
        E("vit", "vision", hf("ViTForImageClassification", "ViTConfig", **VIT), img),
        E("deit", "vision", hf("DeiTForImageClassification", "DeiTConfig", **VIT), img),
        E("beit", "vision", hf("BeitForImageClassification", "BeitConfig", **VIT, use_relative_position_bias=True),
          img),
        E("data2vec-vision", "vision", hf("Data2VecVisionForImageClassification", "Data2VecVisionConfig", **VIT,
                                          use_relative_position_bias=True), img,
          note="its eval call ran the CPU flash kernel's layout into a view (attention_probs_dropout_prob 0 there)"),
        E("dinov2", "vision", hf("Dinov2ForImageClassification", "Dinov2Config",
                                 **{k: v for k, v in VIT.items() if k != "intermediate_size"}, mlp_ratio=2), img),
        E("swin", "vision", hf("SwinForImageClassification", "SwinConfig", image_size=IMAGE, patch_size=2,
                               embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                               hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                               num_labels=NUM_LABELS), img),
        E("swinv2", "vision", hf("Swinv2ForImageClassification", "Swinv2Config", image_size=IMAGE, patch_size=2,
                                 embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                                 num_labels=NUM_LABELS), img),
        E("vit-mae", "vision", hf("ViTMAEForPreTraining", "ViTMAEConfig", **TINY_VIT, decoder_hidden_size=32,
                                  decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
                                  decoder_intermediate_size=64), pixel_batch(),
          note="random masking: argsort of torch.rand noise in the forward"),
        E("clip", "vision", hf("CLIPModel", "CLIPConfig", text_config=dict(ENC), vision_config=TINY_VIT,
                               projection_dim=16), image_text_batch(),
          note="two towers and the contrastive loss (return_loss=True)"),
    ]
    # fmt: on
    # fmt: off
    cnn = [
        E("resnet", "cnn", hf("ResNetForImageClassification", "ResNetConfig", embedding_size=16,
                              hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=NUM_LABELS), img),
        E("convnext", "cnn", hf("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[16, 32],
                                depths=[1, 1], num_stages=2, drop_path_rate=0.1, num_labels=NUM_LABELS), img),
        E("regnet", "cnn", hf("RegNetForImageClassification", "RegNetConfig", embedding_size=16,
                              hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, num_labels=NUM_LABELS), img),
        E("mobilenet-v2", "cnn", hf("MobileNetV2ForImageClassification", "MobileNetV2Config", depth_multiplier=0.35,
                                    image_size=IMAGE, num_labels=NUM_LABELS), img),
        E("convnextv2", "cnn", hf("ConvNextV2ForImageClassification", "ConvNextV2Config", hidden_sizes=[16, 32],
                                  depths=[1, 1], num_stages=2, drop_path_rate=0.1, num_labels=NUM_LABELS), img,
          note="global response normalization"),
    ]
    # fmt: on
    return vision + cnn


def _audio() -> list[ZooEntry]:
    """Audio models (raw audio and log-mel inputs)."""
    E = ZooEntry
    # fmt: off
    audio = [
        E("wav2vec2-ctc", "audio",
          hf("Wav2Vec2ForCTC", "Wav2Vec2Config", vocab_size=32, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
             num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, feat_extract_norm="layer",
             do_stable_layer_norm=True, mask_time_prob=0.0, hidden_dropout=0.1, pad_token_id=0,
             ctc_loss_reduction="mean"), ctc_batch(),
          note="mask_time_prob=0: SpecAugment draws its masks with numpy, no torch seed governs them"),
        E("whisper", "audio",
          hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=100, num_mel_bins=16, d_model=32,
             encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16, max_target_positions=64,
             dropout=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
             suppress_tokens=None, begin_suppress_tokens=None), whisper_batch(),
          note="the encoder takes 32 frames only: another length changes the labels' length"),
    ]
    # fmt: on
    return audio


def _timm() -> list[ZooEntry]:
    """timm models (logits only: the loss is cross-entropy of them)."""
    E = ZooEntry
    # fmt: off
    transformers_ = [
        ("vit_tiny_patch16_224", dict(TIMM_DROP, img_size=IMAGE, patch_size=8, depth=4)),
        ("deit_tiny_patch16_224", dict(TIMM_DROP, img_size=IMAGE, patch_size=8, depth=4)),
        ("mixer_s16_224", dict(TIMM_DROP, img_size=IMAGE)),
        ("xcit_nano_12_p16_224", dict(TIMM_DROP, img_size=IMAGE, patch_size=8, depth=2)),  # arange(d) // 2
        ("cait_xxs24_224", dict(TIMM_DROP, img_size=IMAGE, patch_size=8, depth=2)),
        # dynamic_img_size: resamples its position embedding (antialiased bicubic) on every call
        ("test_vit", dict(TIMM_DROP, img_size=IMAGE)),
    ]
    # fmt: on
    cnns: list[tuple[str, dict[str, Any]]] = [  # CNN_IMAGE: see there
        ("resnet10t", TIMM_DROP),
        ("resnet18", TIMM_DROP),
        ("efficientnet_b0", TIMM_DROP),
        ("mobilenetv3_small_050", TIMM_DROP),
        ("regnetx_002", TIMM_DROP),
        ("convnext_atto", TIMM_DROP),
        ("ghostnet_050", dict(drop_rate=0.1)),
        ("mixnet_s", dict(drop_rate=0.1)),  # mixed kernel sizes per channel group; chaotic at a batch of two
        ("skresnet18", dict(drop_rate=0.1)),  # selective kernels: BatchNorm over pooled 1x1 maps
        ("densenet121", dict(drop_rate=0.1, block_config=(2, 2, 2, 2))),
        ("repvgg_a0", TIMM_DROP),
        ("efficientvit_b0", dict(drop_rate=0.1)),
        ("levit_128s", dict(TIMM_DROP, img_size=CNN_IMAGE)),
        # eval mode fills an attention-bias cache dict, which train() empties: an input, not a constant
        ("efficientformerv2_s0", dict(drop_rate=0.1, img_size=CNN_IMAGE)),
        ("efficientvit_m0", dict(drop_rate=0.1)),
        ("mobilevit_xxs", TIMM_DROP),
        ("lcnet_050", TIMM_DROP),
        ("hgnetv2_b0", dict(drop_rate=0.1)),  # a scalar scale's gradient: a sum over the whole batch
        ("coat_tiny", dict(drop_rate=0.1, img_size=CNN_IMAGE)),  # a submodule registered under two paths
        ("sequencer2d_s", dict(drop_rate=0.1, img_size=CNN_IMAGE)),  # LSTMs
        ("edgenext_xx_small", dict(drop_rate=0.1)),
        ("fastvit_t8", dict(drop_rate=0.1)),
        ("mobilenetv4_conv_small", dict(drop_rate=0.1)),
        ("convit_tiny", dict(drop_rate=0.1, img_size=CNN_IMAGE)),  # a buffer rebuilt in forward at another size
        ("nf_resnet26", dict(drop_rate=0.1)),  # weight standardization in the forward
        ("poolformerv2_s12", dict(drop_rate=0.1)),  # one-group GroupNorm of large-mean activations
        ("resnest14d", dict(drop_rate=0.1)),  # split attention: a softmax over the radix
        ("pvt_v2_b0", dict(drop_rate=0.1)),  # spatial-reduction attention
        ("eva02_tiny_patch14_224", dict(drop_rate=0.1, img_size=CNN_IMAGE, patch_size=8)),  # rotary, SwiGLU
        ("gmlp_ti16_224", dict(drop_rate=0.1, img_size=CNN_IMAGE)),  # spatial gating
        ("botnet26t_256", dict(drop_rate=0.1, img_size=CNN_IMAGE)),  # relative-position self-attention
    ]
    specs = [(n, kw, IMAGE) for n, kw in transformers_] + [(n, kw, CNN_IMAGE) for n, kw in cnns]
    return [
        E(
            f"timm-{name}",
            "timm",
            timm_model(name, **kw),
            image_batch("x", side),
            external_loss=True,
            note="" if side == IMAGE else f"{side}x{side} images",
        )
        for name, kw, side in specs
    ]


def _torchvision() -> list[ZooEntry]:
    """torchvision's classifiers (``torchvision_models``), at ``CNN_IMAGE``."""
    from .torchvision_models import SPECS, torchvision_model

    batch = image_batch("x", CNN_IMAGE)
    return [
        ZooEntry(f"tv-{n}", "torchvision", torchvision_model(n, **kw), batch, external_loss=True, note=note)
        for n, kw, note in SPECS
    ]


def _entries() -> list[ZooEntry]:
    return (
        _text_encoders()
        + _decoders()
        + _decoder_variants()
        + _handwritten()
        + _encoder_decoders()
        + _vision()
        + _audio()
        + _timm()
        + _torchvision()
    )


MODELS: dict[str, ZooEntry] = {e.name: e for e in _entries()}
# A quick model of each of four families: what the default (CI) test run covers.
SAMPLE: tuple[str, ...] = ("bert-cls", "gpt2", "resnet", "timm-deit_tiny_patch16_224")


def get(name: str) -> ZooEntry:
    """The entry of that name (a KeyError lists the names)."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"no zoo model {name!r}; the models are {sorted(MODELS)}") from None
