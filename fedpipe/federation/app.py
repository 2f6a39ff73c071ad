"""fedpipe's Flower app, as it travels: the FAB (Flower's app bundle, a zip) that `flwr run` builds from the one
pyproject.toml fedpipe writes, and the check a site makes of every FAB before it answers a message of its run.

A site runs fedpipe's own code only: its worker (`fedpipe.federation.worker`) never installs or imports anything from a
FAB. It still refuses a FAB that is not fedpipe's own, so that a run nobody at the site agreed to (another app submitted
through the same SuperLink) gets a named refusal instead of fedpipe's handlers answering it. fedpipe's FAB:

- holds pyproject.toml and Flower's manifest (.info/CONTENT) and nothing else (no Python file, nothing to execute);
- names fedpipe's ServerApp and ClientApp (`fedpipe.federation.server_app:app`, `fedpipe.federation.client_app:app`);
- carries exactly the run-config keys fedpipe writes (`CONFIG_KEYS`);
- is built by the site's own fedpipe version (its [project] version).

Flower 1.42's FAB layout: flwr/cli/build.py (`build_fab_from_files` writes the files and `.info/CONTENT`, a line
"path,sha256,size" per file). No Flower import here.
"""

from __future__ import annotations

import io
import json
import tomllib
import zipfile

from fedpipe import __version__

NAME = "fedpipeapp"
COMPONENTS = {"serverapp": "fedpipe.federation.server_app:app", "clientapp": "fedpipe.federation.client_app:app"}
#: the run-config keys fedpipe's ServerApp reads (`fedpipe.federation.server_app.main`), all of them, nothing else
CONFIG_KEYS = ("spec-file", "out-dir", "store", "prefix", "stop-after", "timeout", "round-timeout", "rejoin-wait")
#: what a FAB of fedpipe's holds
FILES = frozenset({"pyproject.toml", ".info/CONTENT"})
#: a FAB of fedpipe's is one short pyproject: anything larger is not one, and is not unpacked
MAX_FAB_BYTES = 64 * 1024


class AppRefused(Exception):
    """A FAB that is not fedpipe's own app (its message says why, in one line)."""


def pyproject(config: dict) -> str:
    """The app's pyproject.toml with run config `config` (every key of CONFIG_KEYS)."""
    missing = set(CONFIG_KEYS) ^ set(config)
    if missing:
        raise ValueError(f"fedpipe's app config takes exactly {', '.join(CONFIG_KEYS)}; not {', '.join(sorted(missing))}")
    value = lambda v: json.dumps(v) if isinstance(v, str) else repr(float(v))  # noqa: E731  (TOML basic strings are JSON's)
    lines = ["[project]", f'name = "{NAME}"', f'version = "{__version__}"',
             'description = "fedpipe\'s ServerApp and ClientApp (the code lives in the fedpipe package at the sites and the server)"',
             'license = "Apache-2.0"', "dependencies = []", "", "[tool.flwr.app]", 'publisher = "fedpipe"', "",
             "[tool.flwr.app.components]", *(f'{k} = "{v}"' for k, v in COMPONENTS.items()), "", "[tool.flwr.app.config]",
             *(f"{k} = {value(config[k])}" for k in CONFIG_KEYS)]
    return "\n".join(lines) + "\n"


def check_fab(content: bytes, run_config: dict | None = None) -> dict:
    """The FAB's pyproject (parsed) if `content` is fedpipe's own app for this site's version, and `run_config` (the
    run's config as Flower fused it, when given) holds fedpipe's keys only; else AppRefused saying why. Bounded: the
    zip's size and entries are checked before anything is decompressed, and only pyproject.toml is."""
    if len(content) > MAX_FAB_BYTES:
        raise AppRefused(f"the app bundle is {len(content)} bytes; fedpipe's is one short pyproject.toml (at most {MAX_FAB_BYTES})")
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as z:
            names = [i.filename for i in z.infolist()]
            other = sorted(set(names) - FILES)
            if other:
                code = [n for n in other if n.endswith((".py", ".pyc", ".so", ".pth", ".sh"))]
                raise AppRefused(f"the app bundle holds {', '.join((code or other)[:5])}: fedpipe's holds no code, only "
                                 "pyproject.toml (a site runs fedpipe's own code and nothing a run brings)")
            info = z.getinfo("pyproject.toml")
            if info.file_size > MAX_FAB_BYTES:
                raise AppRefused(f"the app's pyproject.toml is {info.file_size} bytes unpacked: not fedpipe's")
            project = tomllib.loads(z.read(info).decode("utf-8"))
    except AppRefused:
        raise
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError) as e:
        raise AppRefused(f"the app bundle is not fedpipe's ({type(e).__name__}: {str(e)[:120]})") from None
    app = project.get("tool", {}).get("flwr", {}).get("app", {})
    components = app.get("components", {})
    if components != COMPONENTS:
        raise AppRefused(f"the app's components are {json.dumps(components)[:200]}, not fedpipe's ServerApp and ClientApp")
    version = project.get("project", {}).get("version")
    if project.get("project", {}).get("name") != NAME or version != __version__:
        raise AppRefused(f"the app is {project.get('project', {}).get('name')!r} version {version!r}; this site runs "
                         f"fedpipe {__version__} and takes {NAME!r} of that version only")
    for where, keys in (("the app's config", app.get("config", {})), ("the run's config", run_config)):
        if keys is not None and set(keys) != set(CONFIG_KEYS):
            odd = sorted(set(keys) ^ set(CONFIG_KEYS))
            raise AppRefused(f"{where} has keys fedpipe does not write or lacks its own: {', '.join(odd[:8])}")
    return project


def run_name(run_config: dict) -> str:
    """The run's name as a site's policy matches it (`federations[].run_prefix`): the run's id in its store (its
    `prefix`, `<run>/federation`), or, for the try-out, the folder its server writes to."""
    prefix = str(run_config.get("prefix", ""))
    return prefix.removesuffix("/federation") if prefix else str(run_config.get("out-dir", ""))
