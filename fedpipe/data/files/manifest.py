"""The manifest of a user's federated dataset: which layout the files have, which columns mean what, and
the label names (the class order). It lies beside the data as `fedpipe-data.yaml`, is written by
`fedpipe data init` from a look at the files, may be edited by hand, and is validated when read (it comes
from a data root someone else may have written: bounded, parsed as plain YAML, never executed).

Two layouts:

- `image_folders`: `<source>/<client>/<label>/<image>`: one folder per client, one sub-folder per label,
  PNG or JPEG files inside (decoded by Pillow, resized to data.image_size when sizes differ).
- `table`: Parquet or CSV files with a client column, a label column, and the inputs as either numeric
  feature columns, an image column (a path relative to the source, or the image's bytes), or a text
  column (tokenized as AG News is).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Annotated, Literal

from pydantic import Field, model_validator

from fedpipe.config import Section

MANIFEST_NAME = "fedpipe-data.yaml"
MANIFEST_MAX_BYTES = 4 * 2**20  # a manifest of 100,000 label names is ~2 MB; more is not a manifest
MAX_LABELS = 100_000
MAX_FEATURES = 100_000
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
TABLE_EXTENSIONS = (".parquet", ".csv")

_COLUMN = Field(min_length=1, max_length=256)
_INTEGER_NAME = re.compile(r"[+-]?\d+")


class ImageFoldersLayout(Section):
    """`<source>/<client>/<label>/<image>`: one folder per client, one sub-folder per label."""

    layout: Literal["image_folders"] = "image_folders"
    """The layout: `image_folders`."""

    channels: Literal[1, 3] = 3
    """Channels every image is converted to: 1 (grayscale, Pillow mode L) or 3 (RGB)."""


class TableLayout(Section):
    """Parquet or CSV files, one row per sample, with a client column and a label column."""

    layout: Literal["table"] = "table"
    """The layout: `table`."""

    files: tuple[Annotated[str, _COLUMN], ...] = ()
    """The table files, relative to the source (.parquet or .csv); empty: every .parquet and .csv file
    under the source, in key order. All must have the same columns."""

    client_column: str = Field("client", min_length=1, max_length=256)
    """The column naming each row's client (the natural partition: a site, a device, a writer)."""

    label_column: str = Field("label", min_length=1, max_length=256)
    """The column holding each row's label (a name from `labels`, or its index)."""

    id_column: str | None = Field(None, min_length=1, max_length=256)
    """A column naming each sample for good (a record number, a file name): with the client, it fixes the
    sample's train/validation/test split in every drop (`fedpipe.data.identity`). None: the client and
    the row's input values name it (a row relabelled in a later drop keeps its split; changing any input
    value makes it a new sample)."""

    features: tuple[Annotated[str, _COLUMN], ...] = Field((), max_length=MAX_FEATURES)
    """Numeric feature columns (a tabular input of len(features) values); exclusive with image_column
    and text_column."""

    image_column: str | None = Field(None, min_length=1, max_length=256)
    """A column holding each row's image: a path relative to the source (string) or the encoded
    PNG/JPEG bytes (binary)."""

    channels: Literal[1, 3] = 3
    """With image_column: channels every image is converted to (1: grayscale, 3: RGB)."""

    text_column: str | None = Field(None, min_length=1, max_length=256)
    """A column holding each row's text, tokenized as AG News is (lower-case words, the most frequent
    training words as the vocabulary)."""

    @model_validator(mode="after")
    def _one_input(self) -> TableLayout:
        given = [n for n, v in (("features", self.features), ("image_column", self.image_column),
                                ("text_column", self.text_column)) if v]
        if len(given) != 1:
            raise ValueError(f"a table's inputs are exactly one of features, image_column, text_column; "
                             f"got {', '.join(given) or 'none'}")
        return self


class DataManifest(Section):
    """fedpipe-data.yaml: the layout of a user's federated dataset and its label names."""

    format: Literal["fedpipe-data"] = "fedpipe-data"
    version: Literal[1] = 1
    source: Annotated[ImageFoldersLayout | TableLayout, Field(discriminator="layout")]
    """How the files are laid out (image_folders or table) and what their columns mean."""

    labels: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(min_length=2, max_length=MAX_LABELS)
    """The label names, in class order (class i is labels[i]); at least two. A label in the files
    that is not listed here is an error naming its file or row."""

    @model_validator(mode="after")
    def _distinct_labels(self) -> DataManifest:
        if len(set(self.labels)) != len(self.labels):  # counted in one pass: list.count per label was quadratic
            dup = sorted(x for x, n in Counter(self.labels).items() if n > 1)
            raise ValueError(f"labels must be distinct; repeated: {', '.join(dup[:5])}"
                             + (f" ... ({len(dup)} in all)" if len(dup) > 5 else ""))
        return self


NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")


def label_order(names: set[str]) -> list[str]:
    """Label folder names in the order a person reads them: numeric when every one is an integer, in counting
    order when every one is an English number word (zero, one, two, ...), else naturally (class2 before
    class10; case aside). `fedpipe data init --labels` sets any other order."""
    if all(_INTEGER_NAME.fullmatch(n) and len(n) <= 18 for n in names):  # int() of a 5,000-digit name raises
        return sorted(names, key=lambda n: (int(n), n))
    if all(n.lower() in NUMBER_WORDS for n in names) and len({n.lower() for n in names}) == len(names):
        return sorted(names, key=lambda n: NUMBER_WORDS.index(n.lower()))
    return sorted(names, key=_natural_key)


def _natural_key(name: str) -> tuple:
    """'class10' -> ((1, 'class'), (0, 10), ...): digits compare as numbers, text case-insensitively."""
    parts = re.split(r"(\d{1,18})", name)
    return (*((0, int(p)) if p.isdigit() else (1, p.lower()) for p in parts if p), name)
