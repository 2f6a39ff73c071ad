"""MkDocs hooks (mkdocs.yml `hooks:`) that tie the site to the code while it builds:

- a generated page (scripts/gen_docs.py) that differs from what the code generates now is a warning, so
  `mkdocs build --strict` fails on it, naming the page and the command that rewrites it;
- the pictures (scripts/docs_pictures.py) are drawn and added to the site as files, never written into docs/;
- the build says which MkDocs and theme built it (docs/docs.md, "The theme").
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_pictures  # noqa: E402
import gen_docs  # noqa: E402

# under "mkdocs": MkDocs counts this logger's warnings, and --strict fails the build on them
log = logging.getLogger("mkdocs.hooks.fedpipe")


def on_startup(command, dirty, **kwargs) -> None:
    """Say what builds the site: MkDocs and Material for MkDocs, pinned; Zensical tried, not adopted (docs/docs.md)."""
    from importlib.metadata import version

    log.info(f"fedpipe's site: MkDocs {version('mkdocs')} with Material for MkDocs {version('mkdocs-material')} "
             "(pinned below 10; Zensical, Material's successor, tried at 0.0.73 and not adopted: it runs no MkDocs "
             "hooks and does not check the nav; docs/docs.md, 'The theme')")


def on_pre_build(config, **kwargs) -> None:
    for path in gen_docs.stale_pages(Path(config.docs_dir)):
        log.warning(f"{Path(config.docs_dir).name}/{path} is stale: it differs from what the code generates now "
                    f"(scripts/gen_docs.py); run {gen_docs.REGENERATE} and commit the page")


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for path, content in docs_pictures.all_pictures().items():
        files.append(File.generated(config, path, content=content))
    return files
