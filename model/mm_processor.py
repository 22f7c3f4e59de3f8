"""Image inputs for vision-language models: decode and check image bytes, preprocess them with the
model's own transformers processor, and make the engine's :class:`MultiModalInput`.

Preprocessing (resize, crop, rescale, normalize) is transformers' (``LlavaProcessor`` with its
``CLIPImageProcessor``, loaded from the model directory); so is the number of placeholder tokens an
image expands to. Nothing here fetches from the network: images come as bytes (a ``data:`` URL's
payload, or a file under an allowed directory, see ``rayinfer.serve.images``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import torch

from rayinfer.engine.errors import InvalidRequestError
from rayinfer.engine.multimodal import hash_pixel_values, placeholder_ranges
from rayinfer.engine.types import MultiModalInput

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Bytes of a PNG, JPEG or WebP file -> an RGB ``PIL.Image``, fully decoded.

    Raises:
        InvalidRequestError ("image"): for another or unknown format, corrupt or truncated bytes, or more
            than ``max_pixels`` pixels (checked from the header, before the pixels are decoded).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except UnidentifiedImageError:
        raise InvalidRequestError(f"image is not a valid {'/'.join(IMAGE_FORMATS)} file (unknown format or corrupt "
                                  "bytes)", "image") from None
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"image has too many pixels: {e}", "image") from None
    w, h = img.size
    if w * h > max_pixels:
        raise InvalidRequestError(f"image has {w}x{h} = {w * h} pixels, more than the limit of {max_pixels}", "image")
    try:
        img.load()
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt pixel data
        raise InvalidRequestError(f"image {img.format} data is corrupt: {e}", "image") from None
    return img.convert("RGB")


class ImageInputProcessor:
    """The model's transformers processor (``AutoProcessor`` of its directory), applied one image at a time.

    Args:
        model_dir: a Hugging Face-format directory with ``processor_config.json`` (or
            ``preprocessor_config.json``) and a tokenizer.
    Attributes:
        image_token, image_token_id: the placeholder the processor expands.
        patch_size: the vision encoder's patch size in pixels (for load balancing by patches).
    Raises:
        ValueError: if the directory has no image processor.
    """

    def __init__(self, model_dir: str | Path):
        import transformers

        self.processor: Any = transformers.AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        if not hasattr(self.processor, "image_processor"):
            raise ValueError(f"model directory '{model_dir}' has no image processor")
        self.image_token: str = self.processor.image_token
        self.image_token_id: int = self.processor.image_token_id
        self.patch_size: int = getattr(self.processor, "patch_size", None) or 14

    @classmethod
    def for_model(cls, model: str | Path) -> "ImageInputProcessor | None":
        """The processor of a vision-language model directory; None for a text-only model."""
        from rayinfer.model.loader import load_config, resolve_model

        resolved = resolve_model(model)
        if isinstance(resolved, str):
            return None
        config = load_config(resolved)
        if getattr(config, "vision_config", None) is None:
            return None
        return cls(resolved)

    def preprocess(self, image) -> tuple[torch.Tensor, int]:
        """One PIL image -> (pixel_values [3, H, W] float32, number of placeholder tokens it expands to)."""
        out = self.processor(text=[self.image_token], images=[image], return_tensors="pt")
        num_tokens = int((out["input_ids"][0] == self.image_token_id).sum())
        return out["pixel_values"][0].float(), num_tokens

    def mm_input(self, image, offset: int) -> MultiModalInput:
        """The engine input of one image whose placeholders start at prompt position ``offset``."""
        pixel_values, n = self.preprocess(image)
        patches = (pixel_values.shape[-2] // self.patch_size) * (pixel_values.shape[-1] // self.patch_size)
        return MultiModalInput(hash_pixel_values(pixel_values), offset, n, pixel_values=pixel_values,
                               num_patches=patches)

    def placeholder_ids(self, num_tokens: int) -> list[int]:
        return [self.image_token_id] * num_tokens

    def prompt_with_images(self, text: str, images: Sequence[Any]) -> tuple[list[int], list[MultiModalInput]]:
        """A text prompt with one ``image_token`` per image -> (prompt token ids, the images' inputs),
        expanded by the processor exactly as transformers does it.

        Raises:
            InvalidRequestError ("prompt"): if the text's image tokens do not match ``images``.
        """
        out = self.processor(text=[text], images=list(images) or None, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        if not images:
            return ids, []
        pixels = out["pixel_values"].float()
        n = sum(1 for t in ids if t == self.image_token_id) // len(images)
        ranges = placeholder_ranges(ids, self.image_token_id, [n] * len(images))
        patches = (pixels.shape[-2] // self.patch_size) * (pixels.shape[-1] // self.patch_size)
        return ids, [MultiModalInput(hash_pixel_values(p), off, length, pixel_values=p, num_patches=patches)
                     for p, (off, length) in zip(pixels, ranges)]
