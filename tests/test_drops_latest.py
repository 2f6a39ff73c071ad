"""`latest` picks only a real, complete, dated drop (issue 30, item 3): a symbolic link to another tenant's data,
a name that sorts after every date, and a half-uploaded drop never become `latest`, in a folder and in S3 (the
S3 test server, moto's emulator)."""

from __future__ import annotations

import io
import logging
import os

import pytest
from own_data import upload_folder, write_digit_folders

from fedpipe.errors import DataError
from fedpipe.run.config import load_config, with_data_snapshot
from fedpipe.store.source import DropPolicy, open_source


def _drop(path, limit: int = 40, complete: bool = True):
    write_digit_folders(path, limit=limit)
    if complete:
        (path / "_SUCCESS").write_text("")
    return path


def test_a_link_a_last_sorting_name_and_a_half_upload_never_become_latest(tmp_path, caplog):
    drops = tmp_path / "drops"
    _drop(drops / "2026-01-01")
    other = _drop(tmp_path / "other-tenant" / "2099-01-01")
    os.symlink(other, drops / "2099-12-31")  # a link named as the newest drop, pointing out of the root
    _drop(drops / "zz-provider-b")  # complete, but not named as a drop
    _drop(drops / "~provider-c")
    _drop(drops / "2026-03-01", complete=False)  # a newer drop still being uploaded: no marker yet
    with caplog.at_level(logging.INFO, logger="fedpipe.store.source"):
        assert open_source(str(drops / "latest")).url() == str(drops / "2026-01-01")
    assert "2026-03-01 are not complete" in caplog.text and "zz-provider-b" in caplog.text
    (drops / "2026-03-01" / "_SUCCESS").write_text("")  # the upload finished
    assert open_source(str(drops / "latest")).url() == str(drops / "2026-03-01")
    # a drop whose own manifest was written after its data is complete too
    later = _drop(drops / "2026-04-01", complete=False)
    (later / "fedpipe-data.yaml").write_text("written last")
    assert open_source(str(drops / "latest")).url() == str(later)
    # ... and not when a data file was written after it (the manifest first, then the upload)
    newest_png = max(later.rglob("*.png"), key=lambda p: p.stat().st_mtime)
    os.utime(later / "fedpipe-data.yaml", (newest_png.stat().st_mtime - 10,) * 2)
    assert open_source(str(drops / "latest")).url() == str(drops / "2026-03-01")
    # the run config's policy is what a run uses; `none` trusts any drop, another pattern names other drops
    cfg = load_config(None, ["data.dataset=files", f"data.source={drops}/latest", "data.drop_complete=none"])
    assert with_data_snapshot(cfg).data.source == str(later)
    assert open_source(str(drops / "latest"), DropPolicy(r"zz-.*", "none")).url() == str(drops / "zz-provider-b")
    half = tmp_path / "half"
    _drop(half / "2026-05-01", complete=False)
    with pytest.raises(DataError, match="none of its 1 drop"):
        open_source(str(half / "latest"))


def test_a_bad_drop_pattern_is_a_config_error():
    from fedpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="data.drop_pattern"):
        load_config(None, ["data.drop_pattern=([0-9"])


@pytest.mark.services
def test_in_s3_only_complete_dated_prefixes_are_drops(tmp_path, raw_client):
    bucket = "drops-latest"
    upload_folder(raw_client, write_digit_folders(tmp_path / "a", limit=30), bucket, "drops/2026-01-01")
    upload_folder(raw_client, write_digit_folders(tmp_path / "b", limit=30), bucket, "drops/zz-provider")
    upload_folder(raw_client, write_digit_folders(tmp_path / "c", limit=30), bucket, "drops/2026-02-01", complete=False)
    assert open_source(f"s3://{bucket}/drops/latest").url() == f"s3://{bucket}/drops/2026-01-01"
    raw_client.put_object(bucket, "drops/2026-02-01/_SUCCESS", io.BytesIO(b""), 0)
    assert open_source(f"s3://{bucket}/drops/latest").url() == f"s3://{bucket}/drops/2026-02-01"
