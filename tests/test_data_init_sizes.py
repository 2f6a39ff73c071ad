"""`fedpipe data init` on image folders of several sizes (issue 43, A18): a tie between equally common sizes is
called a tie, the advice is whole sentences, and an exported model's spec says how images of another size are made
to fit (what training did with data.image_size)."""

from __future__ import annotations

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.models.export import ServingSpec


def _folders(root, sizes: dict[tuple[int, int], int]):
    """<root>/<site>/<label>/<n>.png, `sizes` {(width, height): count}, spread over two sites and two labels."""
    n = 0
    for (w, h), count in sizes.items():
        for _ in range(count):
            folder = root / f"site{n % 2}" / str(n % 3)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((h, w), n % 250, dtype=np.uint8), mode="L").save(folder / f"{n}.png")
            n += 1
    return root


def test_equally_common_sizes_are_called_a_tie_and_the_advice_reads(tmp_path):
    root = _folders(tmp_path / "data", {(12, 12): 6, (8, 8): 6, (20, 10): 3})
    out = CliRunner().invoke(app, ["data", "init", str(root)])
    assert out.exit_code == 0, out.output
    assert "smallest of the 2 equally common sizes, 8x8" in out.output
    assert "the most common" not in out.output
    assert "data.image_size=8 resizes every image to 8x8 (bilinear, the aspect ratio not kept)." in out.output


def test_one_most_common_size_is_named_so(tmp_path):
    root = _folders(tmp_path / "data", {(12, 12): 7, (8, 8): 5})
    out = CliRunner().invoke(app, ["data", "init", str(root)])
    assert out.exit_code == 0, out.output
    assert "12 is the longer side of the most common size, 12x12" in out.output


def test_the_spec_says_how_images_of_another_size_are_resized():
    spec = ServingSpec("r", "fedavg", "lenet5", "image", (1, 28, 28), (0.5,), (0.5,), ("0", "1"), None)
    rule = spec.to_json()["input"]["resize"]
    assert "28x28" in rule and "bilinear" in rule and "aspect ratio is not kept" in rule
    table = ServingSpec("r", "fedavg", "mlp", "table", (4,), (0.0,) * 4, (1.0,) * 4, ("a", "b"), None)
    assert table.to_json()["input"]["resize"] is None
