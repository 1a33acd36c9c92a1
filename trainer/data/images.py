"""Images as cameras and tools write them → the RGB pixels we train on.

* **EXIF orientation.** Records' coordinates (and ``width`` / ``height``) refer to the *displayed* image: the
  stored pixels with their EXIF orientation applied, as every viewer and COCO tool shows them. Orientations 5-8
  (transposed / rotated 90°) swap width and height. One function, ``orientation_of``, reads the orientation for
  both the header check (``read_header``) and ``load_image`` (which applies it as ``ImageOps.exif_transpose``
  does), so the size checked is the size trained on and pixels and boxes agree; a PNG's eXIf / XMP after the image
  data counts (PIL's own ``exif_transpose`` sees it only once the pixels are decoded).
* **Colour modes.** Every mode in ``COLOUR_MODES`` is converted to RGB on load: modes with an alpha channel (or a
  transparent palette / colour key) are composited on white (the colour of transparent pixels is undefined,
  often black; a viewer shows them over its page, usually white); 16-bit greyscale is scaled to 8 bits
  (value / 257) instead of clipped at 255; the others use PIL's conversion (CMYK without its ICC profile). Any
  other mode (``F``: 32-bit float without a defined range, ``La``, ...) is refused.
* **Headers only.** ``read_header`` opens the file without decoding pixels: size, mode and orientation.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

EXIF_ORIENTATION = 0x0112
#: EXIF orientations that transpose the image (rotate by 90° / 270°, possibly mirrored): width and height swap
TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})
ORIENTATION_NAMES = {1: "normal", 2: "mirrored", 3: "rotated 180°", 4: "flipped", 5: "transposed",
                     6: "rotated 90° clockwise", 7: "transversed", 8: "rotated 90° counter-clockwise"}
#: orientation → the ``PIL.Image.Transpose`` that turns the stored pixels upright (``ImageOps.exif_transpose``'s)
UPRIGHT = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
           7: "TRANSVERSE", 8: "ROTATE_90"}
#: PNG chunks after the image data that PIL reads into ``info`` on load and its orientation comes from
_PNG_TAIL_CHUNKS = frozenset({b"eXIf", b"tEXt", b"zTXt", b"iTXt"})
#: mode → how ``to_rgb`` converts it (the ``data check`` report shows this)
COLOUR_MODES = {
    "RGB": "as is",
    "RGBX": "padding byte dropped",
    "RGBA": "composited on white",
    "RGBa": "composited on white",
    "LA": "composited on white",
    "PA": "composited on white",
    "P": "palette expanded (transparent entries composited on white)",
    "1": "black and white to RGB",
    "L": "grey to RGB",
    "I;16": "16-bit grey scaled to 8 bits",
    "I;16L": "16-bit grey scaled to 8 bits",
    "I;16B": "16-bit grey scaled to 8 bits",
    "I;16N": "16-bit grey scaled to 8 bits",
    "I": "32-bit integer grey read as 16-bit (clipped to 0..65535) and scaled to 8 bits",
    "CMYK": "PIL's CMYK conversion (the ICC profile is not applied)",
    "YCbCr": "PIL's YCbCr conversion",
    "LAB": "PIL's LAB conversion",
    "HSV": "PIL's HSV conversion",
}
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "PA"})
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


class ImageRefError(ValueError):
    """The image reference cannot be read; the message names it."""


@dataclass(frozen=True)
class ImageHeader:
    """What a file's header says: the stored size, colour mode and EXIF orientation (1 when absent)."""

    stored_width: int
    stored_height: int
    mode: str
    orientation: int = 1
    format: str | None = None

    @property
    def transposed(self) -> bool:
        return self.orientation in TRANSPOSING_ORIENTATIONS

    @property
    def size(self) -> tuple[int, int]:
        """The displayed ``(width, height)``: the stored size with the EXIF orientation applied."""
        if self.transposed:
            return self.stored_height, self.stored_width
        return self.stored_width, self.stored_height


def _png_tail(image) -> dict:
    """The ``info`` entries (eXIf, text, XMP) of the chunks a not yet loaded PNG stores after its image data, read
    by PIL's own chunk parsers while seeking past the image data (nothing decoded); the file position is kept."""
    from PIL import PngImagePlugin

    fp = getattr(image, "fp", None)
    if fp is None or not image.tile:
        return {}
    back = fp.tell()
    stream = PngImagePlugin.PngStream(fp)
    try:
        fp.seek(image.tile[0][2] - 8)  # the first image data chunk's length and type
        while True:
            cid, pos, length = stream.read()
            if cid == b"IEND" or cid == b"fcTL":  # fcTL: the next APNG frame, where PIL's load stops too
                break
            if cid in _PNG_TAIL_CHUNKS:
                stream.call(cid, pos, length)
            fp.seek(pos + length + 4)
    except (struct.error, SyntaxError, EOFError, ValueError, UnicodeDecodeError, zlib.error, OSError):
        pass  # a truncated or broken tail: what was read so far counts
    finally:
        fp.seek(back)
    return stream.im_info


def orientation_of(image) -> int:
    """The EXIF (or XMP) orientation of an open PIL image, 1..8: the one ``ImageOps.exif_transpose`` applies once
    the pixels are loaded, read without decoding them (a PNG's chunks after its image data included: PNG's own
    ``getexif`` would decode the image for them). ``read_header`` and ``load_image`` both take it from here."""
    from PIL import Image

    try:
        if image.format == "PNG" and image.tile:
            probe = Image.new("1", (1, 1))
            probe.info = {**image.info, **_png_tail(image)}
            exif = probe.getexif()
        else:
            exif = Image.Image.getexif(image)
        value = exif.get(EXIF_ORIENTATION, 1)
    except Exception:  # a malformed EXIF block: PIL's exif_transpose would not rotate either
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def upright(image, orientation: int):
    """A loaded copy of ``image`` with ``orientation`` (from ``orientation_of``) applied."""
    from PIL import Image

    name = UPRIGHT.get(orientation)
    return image.transpose(getattr(Image.Transpose, name)) if name else image.copy()


def read_header(path: str | Path) -> ImageHeader:
    """The header of an image file (no pixels decoded); ``ImageRefError`` when it is missing or not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return ImageHeader(im.size[0], im.size[1], im.mode, orientation_of(im), im.format)
    except FileNotFoundError:
        raise ImageRefError(f"image not found: {path}") from None
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageRefError(f"image {path} cannot be read as an image: {exc}") from None


def to_rgb(image):
    """``image`` as RGB, by its mode's rule in ``COLOUR_MODES``; ``ImageRefError`` for any other mode."""
    from PIL import Image

    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image
    if mode not in COLOUR_MODES:
        raise ImageRefError(f"colour mode {mode} cannot be converted to RGB; save the image as 8-bit RGB")
    if mode in _SIXTEEN_BIT:
        import numpy as np

        grey = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        return Image.fromarray(((grey * 255 + 32767) // 65535).astype(np.uint8), "L").convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def _decode(source, name: str, unreadable: str):
    from PIL import Image

    try:
        with Image.open(source) as im:
            shown = upright(im, orientation_of(im))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageRefError(f"{unreadable} ({exc})") from exc
    try:
        return to_rgb(shown)
    except ImageRefError as exc:
        raise ImageRefError(f"image {name}: {exc}") from None


def plain_rgb_file(path: str) -> bool:
    """Whether a plain decoder (``Image.open(path).convert("RGB")``, what ``swift rollout`` runs) sees the pixels
    ``load_image(path)`` gives: an 8-bit RGB file without transparency or an EXIF rotation (from the header)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.mode == "RGB" and "transparency" not in im.info and orientation_of(im) == 1


def canonical_png_base64(path: str) -> str:
    """``load_image(path)`` (EXIF orientation applied, alpha composited on white) as base64 PNG bytes, for a reader
    that decodes images plainly."""
    buf = io.BytesIO()
    load_image(path).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def image_size(ref: str) -> tuple[int, int]:
    """The displayed ``(width, height)`` of the image ``load_image(ref)`` returns, from its header alone (EXIF
    orientation applied); ``ImageRefError`` as ``load_image``."""
    from PIL import Image

    if ref.startswith(("http://", "https://")):
        raise ImageRefError(f"image URLs are not fetched by this server; send a local path or base64 ({ref[:60]})")
    try:
        is_file = not ref.startswith("data:") and Path(ref).is_file()
    except (OSError, ValueError):
        is_file = False
    if is_file:
        return read_header(ref).size
    try:
        data = base64.b64decode(ref.split(",", 1)[-1] if ref.startswith("data:") else ref, validate=True)
        with Image.open(io.BytesIO(data)) as im:
            return ImageHeader(im.size[0], im.size[1], im.mode, orientation_of(im), im.format).size
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as exc:
        raise ImageRefError(f"image {ref[:60]!r} is neither a readable file nor base64 image data") from exc


def load_image(ref: str):
    """An RGB PIL image from a local path, a ``data:`` URI or bare base64 (no network fetches), EXIF orientation
    applied and converted by ``to_rgb``: the pixels the records' coordinates refer to."""
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
            name = repr(ref[:200])
            return _decode(ref, name, f"image file {name} cannot be read as an image")
    neither = f"image {ref[:60]!r} is neither a readable file nor base64 image data"
    try:
        data = base64.b64decode(ref, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRefError(neither) from exc
    return _decode(io.BytesIO(data), "(base64)", neither)
