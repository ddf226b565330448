"""Images for multimodal requests: decode, check and normalise to a float tensor [3, H, W] in [0, 1].

Accepted: a tensor [3, H, W] (uint8, or float in [0, 1]), or the bytes of a binary netpbm image
(PPM 'P6' colour, PGM 'P5' grey, maxval <= 255).  Anything else is an :class:`ImageError` naming
what was received; so is a side that is not a multiple of the patch or larger than allowed.
"""

from __future__ import annotations

import re

import torch


class ImageError(ValueError):
    pass


_HEADER = re.compile(rb"\A(P[56])\s+(?:#[^\n]*\n\s*)*(\d+)\s+(?:#[^\n]*\n\s*)*(\d+)\s+(?:#[^\n]*\n\s*)*(\d+)\s")


def decode_netpbm(data: bytes) -> torch.Tensor:
    m = _HEADER.match(data)
    if not m:
        head = data[:8]
        raise ImageError(f"unknown image format (first bytes {head!r}); accepted: binary PPM (P6), PGM (P5), "
                         "or a tensor [3, H, W]")
    magic, w, h, maxval = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
    if not 0 < maxval <= 255:
        raise ImageError(f"netpbm maxval must be in 1..255, got {maxval}")
    channels = 3 if magic == b"P6" else 1
    body = data[m.end():]
    need = w * h * channels
    if len(body) < need:
        raise ImageError(f"truncated {magic.decode()} image: {len(body)} pixel bytes, need {need}")
    px = torch.frombuffer(bytearray(body[:need]), dtype=torch.uint8).reshape(h, w, channels)
    img = px.permute(2, 0, 1).float() / maxval
    return img.expand(3, h, w).contiguous()


def load_image(image: object, patch: int, max_side: int) -> torch.Tensor:
    if isinstance(image, (bytes, bytearray, memoryview)):
        img = decode_netpbm(bytes(image))
    elif isinstance(image, torch.Tensor):
        if image.dim() != 3 or image.shape[0] != 3:
            raise ImageError(f"an image tensor must be [3, H, W], got {tuple(image.shape)}")
        if image.dtype == torch.uint8:
            img = image.float() / 255.0
        elif image.is_floating_point():
            if not torch.isfinite(image).all() or image.min() < 0 or image.max() > 1:
                raise ImageError("a float image tensor must hold finite values in [0, 1]")
            img = image.float()
        else:
            raise ImageError(f"an image tensor must be uint8 or floating point, got {image.dtype}")
    else:
        raise ImageError(f"unknown image format: {type(image).__name__}; accepted: PPM/PGM bytes or a tensor [3, H, W]")
    _, h, w = img.shape
    if h == 0 or w == 0 or h % patch or w % patch:
        raise ImageError(f"image sides must be positive multiples of the patch ({patch}), got {h}x{w}")
    if max(h, w) > max_side:
        raise ImageError(f"image sides must be at most {max_side}, got {h}x{w}")
    return img


def encode_ppm(img: torch.Tensor) -> bytes:
    """A float image [3, H, W] in [0, 1] as binary PPM bytes (tests, workloads)."""
    _, h, w = img.shape
    px = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()
    return b"P6\n%d %d\n255\n" % (w, h) + px.numpy().tobytes()
