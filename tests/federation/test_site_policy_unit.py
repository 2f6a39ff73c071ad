"""The site's checks without Flower processes: which app bundles a site takes (fedpipe/federation/app.py), each rule of
its policy (fedpipe/federation/policy.py), its log (site_log.py) and its cache bound (own_data.prune_cache).

The FABs here are zips laid out as Flower 1.42 builds them (flwr/cli/build.py: the files, then `.info/CONTENT`, a
"path,sha256,size" line per file); tests/federation/test_site_policy.py submits real ones through `flwr run`."""

from __future__ import annotations

import hashlib
import io
import os
import time
import zipfile

import pytest

from fedpipe import __version__
from fedpipe.errors import ConfigError
from fedpipe.federation import site_log
from fedpipe.federation.app import CONFIG_KEYS, MAX_FAB_BYTES, AppRefused, check_fab, pyproject, run_name
from fedpipe.federation.own_data import prune_cache
from fedpipe.federation.policy import SitePolicy, run_epsilon
from fedpipe.federation.spec import FederationSpec

CONFIG = {"spec-file": "", "out-dir": "/tmp/out", "store": "s3://b/p", "prefix": "cardio-7/federation", "stop-after": "",
          "timeout": 300.0, "round-timeout": 0.0, "rejoin-wait": 0.0}


def fab(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        lines = []
        for name, text in files.items():
            z.writestr(name, text)
            lines.append(f"{name},{hashlib.sha256(text.encode()).hexdigest()},{len(text.encode()) * 8}")
        z.writestr(".info/CONTENT", "\n".join(lines))
    return buf.getvalue()


def test_fedpipes_own_app_is_taken():
    project = check_fab(fab({"pyproject.toml": pyproject(CONFIG)}), CONFIG)
    assert project["project"]["version"] == __version__
    assert run_name(CONFIG) == "cardio-7" and run_name({**CONFIG, "prefix": ""}) == "/tmp/out"


@pytest.mark.parametrize("change, reason", [
    (lambda t: {"pyproject.toml": t, "hostile_client.py": "import os"}, "the app bundle holds hostile_client.py"),
    (lambda t: {"pyproject.toml": t, "notes.txt": "x"}, "the app bundle holds notes.txt"),
    (lambda t: {"pyproject.toml": t.replace("fedpipe.federation.client_app:app", "hostile:app")}, "the app's components are"),
    (lambda t: {"pyproject.toml": t.replace(f'version = "{__version__}"', 'version = "0.0.9"')}, "this site runs fedpipe"),
    (lambda t: {"pyproject.toml": t + 'extra = "x"\n'}, "the app's config has keys fedpipe does not write"),
    (lambda t: {"pyproject.toml": "not = [toml"}, "the app bundle is not fedpipe's"),
], ids=["python-file", "other-file", "components", "version", "config-key", "not-toml"])
def test_any_other_app_is_refused_by_name(change, reason):
    with pytest.raises(AppRefused, match=reason):
        check_fab(fab(change(pyproject(CONFIG))), CONFIG)


def test_a_run_config_with_other_keys_and_odd_bundles_are_refused():
    good = fab({"pyproject.toml": pyproject(CONFIG)})
    with pytest.raises(AppRefused, match="the run's config has keys fedpipe does not write or lacks its own: evil"):
        check_fab(good, {**CONFIG, "evil": "1"})
    with pytest.raises(AppRefused, match="one short pyproject.toml"):
        check_fab(b"\0" * (MAX_FAB_BYTES + 1))
    with pytest.raises(AppRefused, match="not fedpipe's"):
        check_fab(b"PK\x03\x04 not a zip")
    with pytest.raises(ValueError, match="exactly"):
        pyproject({k: CONFIG[k] for k in CONFIG_KEYS[:-1]})


def spec(privacy: dict | None = None, rounds: int = 2, image_size: int | None = 8, method: str = "fedavg", secure: bool = False,
         fraction: float = 1.0) -> FederationSpec:
    return FederationSpec(method={"name": method}, train={"rounds": rounds, "local_epochs": 1, "client_fraction": fraction},
                          engine={}, seed=0, model_name="twonn", input_shape=[1, 8, 8], num_classes=10, num_sites=4,
                          federation={"secure_aggregation": {"enabled": secure}},
                          site_data={"data": {"image_size": image_size, "max_decoded_mb": "auto"}}, privacy=privacy or {})


LOCAL = {"enabled": True, "mode": "local", "noise_multiplier": 4.0, "clip": 1.0, "delta": 1e-5}
STRICT = SitePolicy.model_validate({"name": "hospital-a", "methods": ["fedavg", "superfed_mm"],
                                    "privacy": {"required": True, "mode": "local", "noise_multiplier": 1.0, "clip": 1.0,
                                                "max_epsilon": 8.0, "max_delta": 1e-5},
                                    "limits": {"max_rounds": 100, "max_local_epochs": 5, "max_image_size": 32, "max_decoded_mb": 512},
                                    "release": {"scores": False},
                                    "federations": [{"superlink": "fl.example.org:*", "run_prefix": "cardio-"}]})


@pytest.mark.parametrize("asked, kind, run, reason", [
    (spec(LOCAL), "census", "cardio-1", None),
    (spec(LOCAL), "census", "other-1", "run 'other-1' is not a run it serves"),
    (spec(LOCAL, method="ditto"), "census", "cardio-1", "method ditto is not one it takes"),
    (spec(LOCAL, rounds=101), "train", "cardio-1", "train.rounds 101 above its 100"),
    (spec(LOCAL, image_size=1024), "census", "cardio-1", "image size 1024 above its 32"),
    (spec(None), "census", "cardio-1", "privacy is off; it requires it"),
    (spec({**LOCAL, "seeded_noise": True}), "train", "cardio-1", "seeded noise asked for"),
    (spec({**LOCAL, "noise_multiplier": 1e-9}), "train", "cardio-1", "noise multiplier 1e-09 below its 1"),
    (spec({**LOCAL, "clip": 2.0}), "train", "cardio-1", "clip 2 above its 1"),
    (spec({**LOCAL, "mode": "central"}), "train", "cardio-1", "privacy mode central; it takes local only"),
    (spec({**LOCAL, "delta": 1e-3}), "train", "cardio-1", "delta 0.001 above its 1e-05"),
    (spec(LOCAL, rounds=40), "train", "cardio-1", "epsilon 19.1 above its 8"),
    (spec(LOCAL), "evaluate", "cardio-1", "its evaluation scores may not leave it"),
], ids=["within", "run-prefix", "method", "rounds", "image-size", "no-privacy", "seeded", "less-noise", "larger-clip",
        "central", "delta", "epsilon", "scores"])
def test_each_policy_rule(asked, kind, run, reason):
    got = STRICT.refusal(asked, run, "fl.example.org:443", kind)
    assert got == reason if reason is None else reason in (got or ""), got


def test_the_defaults_and_the_federations_served():
    default = SitePolicy()
    assert default.refusal(spec(), "any", "x:1", "evaluate") is None
    assert default.refusal(spec(image_size=1024), "any", "x:1", "census") == "image size 1024 above its 512"
    assert default.refusal(spec({**LOCAL, "seeded_noise": True}), "any", "x:1", "train").startswith("seeded noise")
    assert default.refusal(spec(secure=False), "any", "x:1", "train") is None
    assert SitePolicy(secure_aggregation_required=True).refusal(spec(), "r", "x:1", "train") == "secure aggregation is off; it requires it"
    assert STRICT.serves("fl.example.org:443") is None
    assert "not one of the federations" in STRICT.serves("evil.example.org:443")
    assert any("epsilon at most 8" in line for line in STRICT.summary())


def test_the_epsilon_a_site_counts():
    """Local mode: against the server itself (q = 1, sigma / 2 per round, `epsilon_against_server`); central mode: the
    run's planned epsilon at its sample rate, capped by target_epsilon (the run stops or calibrates there); both with the
    census's noised label counts first (counted against the server as a round is: conservative, its sensitivity is 1)."""
    from fedpipe.engine.accounting import epsilon_against_server, epsilon_of

    # the census's noised label counts (privacy.census_noise_multiplier, default 10) are spent once before the rounds
    assert run_epsilon(spec(LOCAL, rounds=40)) == pytest.approx(epsilon_against_server("rdp", [[10.0, 1.0, 1], [4.0, 1.0, 40]], 1e-5))
    withheld = {**LOCAL, "census_noise_multiplier": None}
    assert run_epsilon(spec(withheld, rounds=40)) == pytest.approx(epsilon_against_server("rdp", [[4.0, 1.0, 40]], 1e-5))
    central = {**LOCAL, "mode": "central"}
    assert run_epsilon(spec(central, rounds=40, fraction=0.5)) == pytest.approx(epsilon_of("rdp", [[10.0, 1.0, 1], [4.0, 0.5, 40]], 1e-5))
    assert run_epsilon(spec({**central, "target_epsilon": 1.0}, rounds=40)) == 1.0


def test_a_bad_policy_file_is_named(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("privacy:\n  max_epsilon: -1\n")
    with pytest.raises(ConfigError, match=r"privacy.max_epsilon: Input should be greater than 0"):
        SitePolicy.read(path)
    path.write_text("limits:\n  max_rounds: 5\nsurprise: 1\n")
    with pytest.raises(ConfigError, match="surprise"):
        SitePolicy.read(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        SitePolicy.read(path)
    path.write_text("limits:\n  max_rounds: 5\n")
    assert SitePolicy.read(path).limits.max_rounds == 5 and SitePolicy.read(None) == SitePolicy()


def test_the_sites_log_sums_up_each_run(tmp_path):
    site_log.append(tmp_path, {"run": "cardio-1", "method": "fedavg", "kind": "train", "decision": "took", "bytes_out": 800_000})
    site_log.append(tmp_path, {"run": "cardio-1", "method": "fedavg", "kind": "train", "decision": "took", "bytes_out": 800_000})
    site_log.append(tmp_path, {"run": "cardio-2", "method": "ditto", "kind": "census", "decision": "refused",
                               "reason": "method ditto is not one it takes"})
    (tmp_path / site_log.LOG).open("a").write("not json\n")
    lines = site_log.summary(tmp_path)
    assert lines[0] == "cardio-1 (fedavg): 2 messages taken, 0 refused, 0 failed, 1.600 MB sent"
    assert lines[1] == "cardio-2 (ditto): 0 messages taken, 1 refused, 0 failed, 0.000 MB sent"
    assert lines[2] == "    1 x method ditto is not one it takes"
    assert site_log.summary(tmp_path / "none") == ["no message taken or refused yet"]


def test_the_prepared_cache_is_bounded(tmp_path):
    for i, key in enumerate(("old", "mid", "new")):
        (tmp_path / f"{key}.safetensors").write_bytes(b"x" * 400_000)
        (tmp_path / f"{key}.json").write_text("{}")
        os.utime(tmp_path / f"{key}.safetensors", (time.time() - 100 + i, time.time() - 100 + i))
    assert prune_cache(tmp_path, 1, keep="old") == ["mid"]  # 1 MB: the oldest not kept goes first, until it fits
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "new.safetensors", "old.json", "old.safetensors"]
    assert prune_cache(tmp_path, 0, keep="new") == ["old"]  # 0 MB: everything but the entry in use
