"""What a rollout server decodes is what the learner trains on: an image a plain decoder (``swift rollout``'s
``Image.open().convert("RGB")``) would see otherwise (EXIF rotation, transparency) is sent as the learner's pixels."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from trainer.data.images import load_image
from trainer.rollout.server_client import infer_request
from trainer.rollout.types import RolloutRequest


def _sent(path):
    req = RolloutRequest("s", ({"role": "user", "content": [{"type": "image", "image": str(path)}, {"type": "text",
                                                                                                   "text": "hi"}]},), ())
    return infer_request(req)["images"][0]


def _plainly(ref):
    """What a plain decoder makes of a base64 image reference."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(ref))).convert("RGB"))


def test_rotated_and_transparent_images_reach_the_server_as_the_learner_sees_them(tmp_path):
    rgb = Image.fromarray(np.arange(12 * 8 * 3, dtype=np.uint8).reshape(12, 8, 3) * 3)
    rotated = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees
    rgb.save(rotated, exif=exif, quality=100)
    alpha = tmp_path / "alpha.png"
    rgba = np.zeros((6, 6, 4), dtype=np.uint8)
    rgba[..., 0], rgba[:3, :, 3] = 200, 255
    Image.fromarray(rgba, "RGBA").save(alpha)
    for path in (rotated, alpha):
        plain = np.asarray(Image.open(path).convert("RGB"))
        learner = np.asarray(load_image(str(path)))
        assert plain.shape != learner.shape or not np.array_equal(plain, learner), "the fault this guards against"
        ref = _sent(path)
        assert ref != str(path)
        assert np.array_equal(_plainly(ref), learner), path.name
    plain_file = tmp_path / "plain.png"
    rgb.save(plain_file)
    assert _sent(plain_file) == str(plain_file), "a plain RGB file still goes by path"
