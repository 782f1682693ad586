"""core.mounts.check_path: what a volume or drive may not be mounted at (found by the adversarial
run of issue 19: a 300-byte component was a 500 that kept the volume held; /usr/lib/atoll and the
system libraries could be hidden, which broke every command in the sandbox)."""

from __future__ import annotations

import pytest

from atoll.core import errors, mounts


@pytest.mark.parametrize(
    "path",
    [
        "/usr/lib/atoll",
        "/usr/lib/atoll/x",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib/python3",
        "/" + "q" * 256,
        "/data/" + "é" * 128,
        "/x\ny",
    ],
)
def test_refused(path):
    with pytest.raises(errors.InvalidPath) as e:
        mounts.check_path("volume", "v", path)
    assert "volume 'v'" in e.value.message


@pytest.mark.parametrize("path", ["/data", "/" + "q" * 255, "/usr/local/lib/x", "/home/user/work"])
def test_accepted(path):
    assert mounts.check_path("volume", "v", path) == path
