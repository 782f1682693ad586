"""The worker's archive-tier settings (ATOLL_S3_* all or none, bucket, region; ATOLL_DISK_BUDGET_GB) and the budget's disk count."""

import pytest

from atoll.core import config
from atoll.worker.service import settings

S3 = {
    "ATOLL_S3_ENDPOINT": "http://127.0.0.1:8333",
    "ATOLL_S3_BUCKET": "atoll",
    "ATOLL_S3_ACCESS_KEY": "k",
    "ATOLL_S3_SECRET_KEY": "s",
}


def test_no_s3_is_the_local_archive(tmp_path):
    w = settings.load({"ATOLL_HOME": str(tmp_path)})
    assert w.s3 is None and w.archive_dir is None
    w = settings.load({"ATOLL_HOME": str(tmp_path), "ATOLL_ARCHIVE_DIR": "rel/dir"})
    assert w.archive_dir.endswith("/rel/dir") and w.archive_dir.startswith("/")


def test_s3_settings_and_region_default(tmp_path):
    w = settings.load({"ATOLL_HOME": str(tmp_path), **S3})
    assert w.s3.region == "us-east-1" and w.s3.bucket == "atoll"
    assert w.redacted()["s3"] == {
        "endpoint": "http://127.0.0.1:8333",
        "bucket": "atoll",
        "region": "us-east-1",
    }
    w = settings.load({"ATOLL_HOME": str(tmp_path), **S3, "ATOLL_S3_REGION": "eu-west-1"})
    assert w.s3.region == "eu-west-1"


def test_partial_s3_settings_name_what_is_missing(tmp_path):
    env = {"ATOLL_HOME": str(tmp_path), **S3}
    del env["ATOLL_S3_SECRET_KEY"]
    with pytest.raises(config.SettingsError, match="ATOLL_S3_SECRET_KEY not set"):
        settings.load(env)


@pytest.mark.parametrize("bucket", ["A", "Upper", "a/b", "x" * 64, "-ab"])
def test_bad_bucket_names(tmp_path, bucket):
    with pytest.raises(config.SettingsError, match="ATOLL_S3_BUCKET"):
        settings.load({"ATOLL_HOME": str(tmp_path), **S3, "ATOLL_S3_BUCKET": bucket})


def test_bad_endpoint(tmp_path):
    with pytest.raises(config.SettingsError, match="ATOLL_S3_ENDPOINT"):
        settings.load({"ATOLL_HOME": str(tmp_path), **S3, "ATOLL_S3_ENDPOINT": "127.0.0.1:8333"})


def test_disk_budget_setting(tmp_path):
    assert settings.load({"ATOLL_HOME": str(tmp_path)}).disk_budget_gb is None
    assert settings.load({"ATOLL_HOME": str(tmp_path), "ATOLL_DISK_BUDGET_GB": "2.5"}).disk_budget_gb == 2.5
    for bad in ("-1", "lots", "nan"):
        with pytest.raises(config.SettingsError, match="ATOLL_DISK_BUDGET_GB"):
            settings.load({"ATOLL_HOME": str(tmp_path), "ATOLL_DISK_BUDGET_GB": bad})


def test_budget_counts_a_sandbox_dirs_own_blocks_not_its_mounts(tmp_path):
    from atoll.worker.runtimes.budget import sandbox_disk_bytes

    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "checkpoint.img").write_bytes(b"x" * 1_000_000)
    with open(tmp_path / "upper.img", "wb") as f:  # sparse: 1 GiB apparent, 64 KiB written
        f.truncate(2**30)
        f.write(b"y" * 65536)
    for mp in ("rootfs", "upper"):  # what is mounted there (the sandbox's files) is not counted
        (tmp_path / mp).mkdir()
        (tmp_path / mp / "big").write_bytes(b"z" * 3_000_000)
    used = sandbox_disk_bytes(str(tmp_path))
    assert 1_000_000 + 65536 <= used < 1_000_000 + 65536 + 200_000, used
