"""`fedpipe data init SOURCE`: look at a user's files and propose their manifest (`fedpipe-data.yaml`).

Tables (.parquet or .csv files at the top of the source) are described by `table_manifest.infer_table_manifest`;
otherwise files laid out as `<client>/<label>/<image>` give the `image_folders` layout, with the label
folders' names as the labels (in numeric order when every name is an integer) and one channel when every
sampled image is grayscale. The manifest is written with a comment on every field, to be checked and
edited by hand; an existing one is only replaced when asked (`force`).
"""

from __future__ import annotations

import io
import textwrap
from pathlib import PurePosixPath

import numpy as np
import yaml

from fedpipe.data.files import open_data
from fedpipe.data.files.manifest import (
    IMAGE_EXTENSIONS,
    MANIFEST_NAME,
    TABLE_EXTENSIONS,
    DataManifest,
    ImageFoldersLayout,
    TableLayout,
    label_order,
)
from fedpipe.data.files.rows import Problems
from fedpipe.errors import DataError
from fedpipe.store.source import DataSource, SourceObject

__all__ = ["init_manifest", "manifest_yaml", "write_manifest"]

SAMPLED_IMAGES = 50  # images decoded to tell grayscale from colour


def init_manifest(url: str, client_column: str | None = None, label_column: str | None = None) -> tuple[DataManifest, str]:
    """The manifest proposed for the data under `url`, and the URL it would be written to (in the resolved
    source: `.../latest` names the newest drop). Tables: `client_column` / `label_column` name the
    columns when their names are not the usual ones."""
    source, table_file = open_data(url)
    objects = source.list()
    tables = [o for o in objects if "/" not in o.key and o.key.lower().endswith(TABLE_EXTENSIONS)]
    if table_file is not None:  # a table file named itself: the manifest beside it lists it alone
        tables = [o for o in tables if o.key == table_file]
    if tables:
        from fedpipe.data.files.table_manifest import infer_table_manifest

        chosen = objects if table_file is None else [o for o in objects if o.key == table_file]
        manifest = infer_table_manifest(source, chosen, client_column=client_column, label_column=label_column)
        if table_file is not None:
            manifest = manifest.model_copy(update={"source": manifest.source.model_copy(update={"files": (table_file,)})})
    else:
        manifest = _infer_image_folders(source, objects)
    return manifest, source.url(MANIFEST_NAME)


def write_manifest(url: str, manifest: DataManifest, force: bool = False, root: bool = False) -> str:
    """Write `manifest` (with its comment header) as the fedpipe-data.yaml of the source `url` (with `root`: of
    the folder above it, the drops root every drop without a manifest of its own reads); returns where. An
    existing manifest is a DataError unless `force`."""
    source, _ = open_data(url)
    if root:
        above = source.parent()
        if above is None:
            raise DataError(f"{source.url()} has no folder above it to hold a shared manifest; leave out --root.")
        source = above
    if not force and source.exists(MANIFEST_NAME):
        raise DataError(
            f"{source.url(MANIFEST_NAME)} already exists: edit it by hand, or replace it with `fedpipe data init "
            "--force` (its edits are then lost)."
        )
    return source.write(MANIFEST_NAME, manifest_yaml(manifest).encode("utf-8"))


def reorder_labels(manifest: DataManifest, order: list[str]) -> DataManifest:
    """The manifest with its labels in `order` (the same names, in the class order the user wants)."""
    given, found = [o.strip() for o in order if o.strip()], list(manifest.labels)
    given_set, found_set = set(given), set(found)  # `in` on the lists was quadratic at 100,000 labels
    missing, extra = [n for n in found if n not in given_set], [n for n in given if n not in found_set]
    if missing or extra or len(given) != len(found):
        raise DataError(f"--labels must list each label the data holds once, in the order wanted; the data holds "
                        f"{', '.join(found[:30])}{' ...' if len(found) > 30 else ''}"
                        + (f"; missing: {', '.join(missing[:10])}" if missing else "") + (f"; not in the data: {', '.join(extra[:10])}" if extra else ""))
    return manifest.model_copy(update={"labels": tuple(given)})


def _infer_image_folders(source: DataSource, objects: list[SourceObject]) -> DataManifest:
    images = [o for o in objects if len(o.key.split("/")) == 3 and PurePosixPath(o.key).suffix.lower() in IMAGE_EXTENSIONS]
    if not images:
        raise DataError(
            f"{source.url()} holds neither tables (.parquet or .csv files at its top) nor images laid out as "
            "<client>/<label>/<image> (.png, .jpg or .jpeg files), so `fedpipe data init` cannot propose a layout. "
            f"Arrange the files in one of these layouts, or write {MANIFEST_NAME} by hand."
        )
    labels = label_order({o.key.split("/")[1] for o in images})
    if len(labels) < 2:
        raise DataError(
            f"{source.url()} has images under a single label folder ({labels[0]!r}); a classification needs at "
            "least two labels, as <client>/<label>/<image> folders."
        )
    channels = 1 if _all_grayscale(source, images) else 3
    return DataManifest(source=ImageFoldersLayout(channels=channels), labels=tuple(labels))


SIZE_SAMPLE = 2_000  # images whose headers `propose_image_size` reads (spread evenly over the files)


def propose_image_size(url: str) -> tuple[int, str] | None:
    """For image folders of several sizes: the data.image_size to propose (the longer side of the most common size; a
    tie: of the smallest, and the line says it was a tie) and a line saying the sizes found and why that side; None
    when the images share one size (or are tables)."""
    from collections import Counter

    from PIL import Image

    from fedpipe.data.files.images import MAX_IMAGE_BYTES

    source, table_file = open_data(url)
    images = [o for o in source.list() if len(o.key.split("/")) == 3 and PurePosixPath(o.key).suffix.lower() in IMAGE_EXTENSIONS]
    if table_file is not None or not images:
        return None
    sizes: Counter[tuple[int, int]] = Counter()
    step = max(1, len(images) // SIZE_SAMPLE)
    for obj in images[::step][:SIZE_SAMPLE]:
        try:
            with Image.open(io.BytesIO(source.read(obj, MAX_IMAGE_BYTES))) as img:  # the header only: nothing decoded
                sizes[img.size] += 1
        except Exception:  # noqa: BLE001 - an unreadable file: `fedpipe data check` names it
            continue
    if len(sizes) < 2:
        return None
    (w, h), top = max(sizes.items(), key=lambda kv: (kv[1], -kv[0][0] * kv[0][1]))
    found = ", ".join(f"{a}x{b} ({n})" for (a, b), n in sizes.most_common(6)) + (" ..." if len(sizes) > 6 else "")
    sampled = f" in a sample of {sum(sizes.values()):,}" if step > 1 else ""
    tied = sum(n == top for n in sizes.values())
    why = f"the smallest of the {tied} equally common sizes" if tied > 1 else "the most common size"
    return max(w, h), f"the images come in {len(sizes)} sizes{sampled}: {found}; {max(w, h)} is the longer side of {why}, {w}x{h}"


def _all_grayscale(source: DataSource, images: list[SourceObject]) -> bool:
    """True when every readable image of an even sample across the files has equal R, G and B."""
    from fedpipe.data.files.budget import DecodeBudget, auto_decoded_mb
    from fedpipe.data.files.images import MAX_IMAGE_BYTES, decode_image

    budget_mb, _ = auto_decoded_mb()  # each sampled image decoded within the budget a run would read it under
    step = max(1, len(images) // SAMPLED_IMAGES)
    seen = 0
    for obj in images[::step][:SAMPLED_IMAGES]:
        try:
            data = source.read(obj, MAX_IMAGE_BYTES)
        except DataError:
            continue  # `fedpipe data check` reports it
        rgb = decode_image(data, source.url(obj.key), 3, None, Problems(), DecodeBudget(budget_mb))
        if rgb is None:
            continue
        if not (np.array_equal(rgb[0], rgb[1]) and np.array_equal(rgb[1], rgb[2])):
            return False
        seen += 1
    return seen > 0


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width=100, initial_indent=f"# {indent}", subsequent_indent=f"# {indent}  ")


def manifest_yaml(manifest: DataManifest) -> str:
    """The manifest as YAML, under a comment that explains each of its fields (from their documentation)."""
    lines = [
        f"# {MANIFEST_NAME}: how the files beside it are laid out, for a run with data.dataset: files.",
        "# Proposed by `fedpipe data init` from a look at the files: check it, and edit it by hand where it is",
        "# wrong. `fedpipe data check SOURCE` reads the data as a run would and lists every problem.",
        "#",
        "# format, version: which manifest this is (fedpipe-data, version 1); leave them as they are.",
        "# source: how the files are laid out.",
    ]
    layout = manifest.source
    # a table's `channels` means something only with an image column: written out, it would mislead
    unused = {"channels"} if isinstance(layout, TableLayout) and not layout.image_column else set()
    for name, field in type(layout).model_fields.items():
        if name not in unused:
            lines += _comment(f"{name}: {field.description or ''}", "  ")
    lines += _comment(f"labels: {DataManifest.model_fields['labels'].description}", "")
    tree = manifest.model_dump(mode="json", exclude_none=True, exclude={"source": unused})
    body = yaml.safe_dump(tree, sort_keys=False, allow_unicode=True, default_flow_style=False)
    text = "\n".join(lines) + "\n\n" + body
    if DataManifest.model_validate(yaml.safe_load(text)) != manifest:  # pragma: no cover - a dump that does not read back
        raise AssertionError("the manifest does not read back as written")
    return text
