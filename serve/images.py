"""Image content parts of chat messages -> the engine's image inputs, for vision-language models.

An ``image_url`` part's ``url`` is either a ``data:`` URL (base64 PNG, JPEG or WebP) or, only when the
service is configured with an allowed media directory, a local file path (or ``file://`` URL) inside it.
Nothing is ever fetched from the network: an ``http(s)://`` URL is a 400. Every problem with one image
(bad base64, corrupt bytes, another format, too many pixels, too many images) is a 400 that names it,
for that request only.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path

from rayinfer.engine.errors import InvalidRequestError
from rayinfer.engine.types import MultiModalInput
from rayinfer.model.mm_processor import DEFAULT_MAX_IMAGE_PIXELS, ImageInputProcessor, decode_image

_DATA_URL_RE = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.IGNORECASE)


class ImageLoader:
    """Turns image content parts into :class:`MultiModalInput` with the model's processor.

    Args:
        processor: the model's :class:`ImageInputProcessor`.
        max_image_pixels: the most pixels (width x height) of one image.
        max_images: the most images in one request.
        allowed_media_dir: a directory whose files requests may name by path; None allows no paths.
    """

    def __init__(self, processor: ImageInputProcessor, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_images: int = 8, allowed_media_dir: str | None = None):
        self.processor = processor
        self.max_image_pixels = max_image_pixels
        self.max_images = max_images
        self.allowed_media_dir = Path(allowed_media_dir).resolve() if allowed_media_dir else None

    def read(self, url: str) -> bytes:
        """The bytes an ``image_url.url`` names.

        Raises:
            InvalidRequestError ("image_url"): a network URL, bad base64, a path with no allowed media
                directory configured, outside it, or not a readable file.
        """
        m = _DATA_URL_RE.match(url)
        if m is not None:
            try:
                return base64.b64decode(url[m.end():], validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequestError("image data: URL is not valid base64", "image_url") from None
        if url.startswith("data:"):
            raise InvalidRequestError("image data: URL must be base64 (data:image/png;base64,...)", "image_url")
        if re.match(r"^[a-z][a-z0-9+.-]*://", url, re.IGNORECASE) and not url.lower().startswith("file://"):
            raise InvalidRequestError("image URLs are not fetched from the network; send the image as a "
                                      "data: URL (base64)", "image_url")
        if self.allowed_media_dir is None:
            raise InvalidRequestError("local image paths are not allowed by this server (no allowed media "
                                      "directory is configured); send a data: URL", "image_url")
        path = Path(url[len("file://"):] if url.lower().startswith("file://") else url)
        resolved = (self.allowed_media_dir / path).resolve()  # an absolute path stays absolute
        if not resolved.is_relative_to(self.allowed_media_dir):
            raise InvalidRequestError("image path is outside the allowed media directory", "image_url")
        try:
            return resolved.read_bytes()
        except OSError:
            raise InvalidRequestError("image path does not name a readable file in the allowed media directory",
                                      "image_url") from None

    def load(self, url: str, offset: int, index: int) -> MultiModalInput:
        """Read, decode, check and preprocess one image whose placeholders start at prompt position
        ``offset``; ``index`` is its number in the request (from 0).

        Raises:
            InvalidRequestError ("image_url"): see :meth:`read` and
                :func:`~rayinfer.model.mm_processor.decode_image`, or more than ``max_images`` images.
        """
        if index >= self.max_images:
            raise InvalidRequestError(f"too many images: at most {self.max_images} per request", "image_url")
        try:
            image = decode_image(self.read(url), self.max_image_pixels)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"image {index}: {e.message}", "image_url") from None
        return self.processor.mm_input(image, offset)
