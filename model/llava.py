"""LLaVA (``LlavaForConditionalGeneration``): a CLIP ViT vision tower, a two-layer GELU MLP projector, and
our Llama decoder over the paged KV cache.

Why LLaVA first: it is the simplest widely used vision-language layout (one image -> a fixed number of
tokens, spliced into the prompt where the processor put the image placeholders), transformers'
implementation is a ready token-for-token reference, and its decoder is our Llama
(:class:`~rayinfer.model.llama.LlamaForCausalLM`, reused as the base class, not duplicated).

Sources: Liu et al. 2023, "Visual Instruction Tuning" (LLaVA: a linear projector on CLIP features);
Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning" (LLaVA-1.5: the two-layer MLP
projector, features of the penultimate CLIP layer without the CLS token). CLIP: Radford et al. 2021.

How the engine uses it (``is_multimodal``):

- :meth:`LlavaForConditionalGeneration.encode_images` runs once per image (the engine caches the result
  by the image's content hash): ``pixel_values [N, 3, H, W]`` -> ``[N, num_image_tokens, hidden]``.
- :meth:`LlavaForConditionalGeneration.forward` takes ``mm_embeds = (rows [M] int64, embeds [M, hidden])``:
  the decoder's input embeddings at those rows of the step are replaced by the image features (the
  rows hold the image token id, which the processor repeated ``num_image_tokens`` times per image).

Checkpoint names: both transformers layouts load, the one ``save_pretrained`` writes
(``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``,
``multi_modal_projector.*``) and the nested one (``model.language_model.*``, ``model.vision_tower.*``,
``lm_head.*``); ``vision_tower.vision_model.*`` (older CLIP wrappers) too. Vision layers after the
feature layer and the CLIP ``post_layernorm`` are never run, so they are not built and their weights
are skipped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rayinfer.model.llama import LlamaForCausalLM

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}: supported are {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class ClipVisionEmbeddings(nn.Module):
    """Patch convolution + a class token + learned position embeddings (CLIP ViT, fixed image size)."""

    def __init__(self, vc):
        super().__init__()
        self.image_size, self.patch_size = vc.image_size, vc.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(vc.hidden_size))
        self.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, vc.patch_size, vc.patch_size, bias=False)
        self.num_patches = (vc.image_size // vc.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches + 1, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, image_size, image_size] -> [N, 1 + num_patches, hidden] (class token first)."""
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"image is {h}x{w} pixels; the vision tower takes {self.image_size}x{self.image_size} "
                             "(preprocess with the model's image processor)")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [N, D, h/p, w/p]
        patches = patches.flatten(2).transpose(1, 2)  # [N, num_patches, D], row-major over the patch grid
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, vc):
        super().__init__()
        d = vc.hidden_size
        self.num_heads, self.head_dim = vc.num_attention_heads, d // vc.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, S, D] -> [N, S, D]; bidirectional attention within each image (batched SDPA)."""
        n, s, d = x.shape
        q, k, v = (p(x).view(n, s, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5
        return self.out_proj(out.transpose(1, 2).reshape(n, s, d))


class ClipMLP(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.act = _activation(vc.hidden_act)
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer layer: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``."""

    def __init__(self, vc):
        super().__init__()
        self.self_attn = ClipAttention(vc)
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = ClipMLP(vc)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, vc, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(vc) for _ in range(num_layers))


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer up to the deepest layer LLaVA reads.

    Args:
        vc: a ``CLIPVisionConfig``.
        num_layers: encoder layers to build (the rest of the checkpoint's are never run).
    """

    def __init__(self, vc, num_layers: int):
        super().__init__()
        self.embeddings = ClipVisionEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)  # sic: CLIP's name
        self.encoder = ClipEncoder(vc, num_layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """Hidden states ``[N, 1 + num_patches, D]`` after each of ``layers`` (0: the pre-norm embeddings,
        k: after encoder layer k), like transformers' ``hidden_states[k]``."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        out = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            if i > max(layers):
                break
            x = layer(x)
            out[i] = x
        return [out[k] for k in layers]


class LlavaMultiModalProjector(nn.Module):
    """LLaVA-1.5's projector: ``linear_2(gelu(linear_1(features)))``, vision width -> text width."""

    def __init__(self, config, num_feature_layers: int):
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, text_hidden, bias=bias)
        self.act = _activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA over the paged KV cache: the Llama decoder (``self.model``, ``self.lm_head``, the engine's
    interface of :class:`~rayinfer.model.llama.PagedCausalLM`) plus ``vision_tower`` and
    ``multi_modal_projector``.

    ``self.config`` is the text config (what the engine reads: vocab size, context length, EOS);
    ``self.vlm_config`` the whole ``LlavaConfig``.

    Args:
        config: a transformers ``LlavaConfig`` with a Llama ``text_config`` and a CLIP ``vision_config``.
    Raises:
        ValueError: for another text or vision model type, a select strategy other than "default" /
            "full", or an unsupported activation.
    """

    is_multimodal = True

    def __init__(self, config):
        text_config, vc = config.text_config, config.vision_config
        if getattr(text_config, "model_type", "llama") not in ("llama", "mistral"):
            raise ValueError(f"LLaVA with a {text_config.model_type!r} decoder is not supported (Llama only)")
        if getattr(vc, "model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"LLaVA with a {vc.model_type!r} vision tower is not supported (CLIP only)")
        super().__init__(text_config)
        self.vlm_config = config
        self.image_token_id: int = config.image_token_id
        self.select_strategy = config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {self.select_strategy!r}")
        fl = config.vision_feature_layer
        feature_layers = [fl] if isinstance(fl, int) else list(fl)
        n = vc.num_hidden_layers
        self.feature_layers = [k if k >= 0 else n + 1 + k for k in feature_layers]  # indices of hidden_states
        if not all(0 <= k <= n for k in self.feature_layers):
            raise ValueError(f"vision_feature_layer {fl} is outside the vision tower's {n} layers")
        self.vision_tower = ClipVisionTower(vc, max(self.feature_layers))
        self.multi_modal_projector = LlavaMultiModalProjector(config, len(feature_layers))
        self.image_size, self.patch_size = vc.image_size, vc.patch_size
        self.num_image_tokens = (vc.image_size // vc.patch_size) ** 2 + (self.select_strategy == "full")

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image features in the decoder's embedding space.

        Args:
            pixel_values: [N, 3, image_size, image_size] float, from the model's image processor.
        Returns:
            [N, num_image_tokens, text hidden_size] in the model dtype (``num_image_tokens`` =
            ``(image_size / patch_size) ** 2``, plus one with the "full" strategy's class token).
        Raises:
            ValueError: for another image size, or after :meth:`drop_vision_encoder`.
        """
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise ValueError("this replica dropped its vision encoder (a DECODE replica never encodes images)")
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def drop_vision_encoder(self) -> None:
        """Free the vision tower and projector (a DECODE replica: its prompts arrive prefilled, so it only
        needs the images' content hashes). :meth:`encode_images` raises ValueError afterwards."""
        self.vision_tower = None  # pyright: ignore[reportAttributeAccessIssue]
        self.multi_modal_projector = None  # pyright: ignore[reportAttributeAccessIssue]

    def forward(self, input_ids, positions, kv_cache, meta, mm_embeds=None):
        """:meth:`PagedCausalLM.forward`, with ``mm_embeds = (rows [M] int64, embeds [M, hidden])``
        replacing the token embeddings of those rows of the step (None: text only)."""
        if mm_embeds is None:
            return super().forward(input_ids, positions, kv_cache, meta)
        rows, embeds = mm_embeds
        hidden = self.model.embed_tokens(input_ids)
        hidden[rows] = embeds.to(hidden.dtype)
        return self.forward_with_prenorm(input_ids, positions, kv_cache, meta, inputs_embeds=hidden)[0]

    def load_weights(self, named_tensors) -> set[str]:
        """Load a transformers LLaVA checkpoint (either layout, see the module docstring): decoder names
        go through :meth:`LlamaForCausalLM.load_weights` (q/k/v and gate/up stacked), vision and
        projector tensors are copied as they are.

        Returns:
            the names (in this model's ``state_dict``) that were written.
        Raises:
            KeyError: for a name the model does not have; ValueError: on a shape mismatch.
        """
        params = self.state_dict(keep_vars=True)
        loaded: set[str] = set()
        text: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named_tensors:
            name = _canonical_name(name)
            if name.startswith(("model.", "lm_head.")):
                text.append((name, tensor))
                continue
            if name.startswith("vision_tower.") and name not in params and _is_unused_vision_weight(name):
                continue
            if name not in params:
                raise KeyError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded | super().load_weights(text)


def _canonical_name(name: str) -> str:
    """A transformers LLaVA checkpoint name -> this model's (``model.*``/``lm_head.*`` for the decoder)."""
    if name.startswith("model.") and name.split(".")[1] in ("language_model", "vision_tower", "multi_modal_projector"):
        name = name[len("model."):]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name[len("vision_tower.vision_model."):]
    return name


def _is_unused_vision_weight(name: str) -> bool:
    """CLIP's post_layernorm, and encoder layers after the feature layer (never run, not built)."""
    return name.startswith("vision_tower.post_layernorm.") or name.startswith("vision_tower.encoder.layers.")


def num_patches(height: int, width: int, patch_size: int) -> int:
    """Patches of an image of ``height`` x ``width`` pixels at ``patch_size`` (the encoder's work unit)."""
    return math.ceil(height / patch_size) * math.ceil(width / patch_size)
