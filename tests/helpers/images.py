"""Checks of the images rollflow writes (``rollflow plot``, a run's plots)."""

from __future__ import annotations

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(path):
    """Width and height from a PNG's header, after checking it decodes as an image."""
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0.01  # not a blank canvas
    return pixels.shape[1], pixels.shape[0]
