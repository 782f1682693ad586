"""The worker's archive-store settings: ATOLL_S3_* all or none, a valid bucket, region default."""

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
