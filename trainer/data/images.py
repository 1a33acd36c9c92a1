"""Request images: a PIL image from a local path, a ``data:`` URI or bare base64 (no network fetches)."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path


class ImageRefError(ValueError):
    """The image reference cannot be read; the message names it."""


def load_image(ref: str):
    """A PIL image from a local path, a ``data:`` URI or bare base64 (no network fetches)."""
    from PIL import Image

    if ref.startswith(("http://", "https://")):
        raise ImageRefError(f"image URLs are not fetched by this server; send a local path or base64 ({ref[:60]})")
    if ref.startswith("data:"):
        ref = ref.split(",", 1)[-1]
    else:
        try:
            is_file = Path(ref).is_file()
        except (OSError, ValueError):  # name too long, NUL byte, ...
            is_file = False
        if is_file:
            try:
                return Image.open(ref).convert("RGB")
            except (OSError, ValueError, Image.DecompressionBombError) as exc:
                raise ImageRefError(f"image file {ref[:200]!r} cannot be read as an image: {exc}") from exc
    try:
        return Image.open(io.BytesIO(base64.b64decode(ref, validate=True))).convert("RGB")
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as exc:
        raise ImageRefError(f"image {ref[:60]!r} is neither a readable file nor base64 image data") from exc
