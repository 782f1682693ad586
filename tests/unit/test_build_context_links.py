"""Symbolic links in a Dockerfile build context are kept as links (they used to be dropped without
a word): the control plane's tar reader keeps their targets as written, COPY copies them as links,
the wire and the layer keys carry them, and the worker writes them into the layer without ever
following one on the host — a link whose target leads out of the context is kept, and resolved
only inside the sandbox. A hard link becomes what it names: a copy of a regular file, or the
symbolic link itself when it names one (a hard link shares the inode, and that inode is the link)."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile

import pytest

from atoll.controlplane import routes_templates
from atoll.core import dockerfile, errors, templatespec
from atoll.worker.images import layers

DOCKERFILE = b"FROM base\nCOPY . /app/\n"


def _tar(*members: tuple[str, bytes, str, str]) -> bytes:
    """(name, data, kind 'file'|'sym'|'hard'|'fifo', link target) members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data, kind, target in members:
            m = tarfile.TarInfo(name)
            m.type = {"file": tarfile.REGTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE}.get(
                kind, tarfile.FIFOTYPE
            )
            m.linkname, m.size, m.mode = target, len(data) if kind == "file" else 0, 0o644
            tf.addfile(m, io.BytesIO(data) if kind == "file" else None)
    return buf.getvalue()


def _files(context: bytes) -> dict[str, templatespec.FileItem]:
    text, files = routes_templates._context(context)
    spec = dockerfile.parse(text, "links", files)
    (step,) = spec.steps
    return {f.path: f for f in step.files}


def test_links_are_copied_as_links_with_their_targets_as_written():
    got = _files(
        _tar(
            ("Dockerfile", DOCKERFILE, "file", ""),
            ("data.txt", b"hello\n", "file", ""),
            ("rel", b"", "sym", "data.txt"),
            ("abs", b"", "sym", "/etc/os-release"),
            ("sub/out", b"", "sym", "../../../../etc/shadow"),
            ("dangling", b"", "sym", "nowhere"),
            ("hard", b"", "hard", "data.txt"),
        )
    )
    assert got["/app/data.txt"].link is None and got["/app/data.txt"].data == b"hello\n"
    assert {p: f.link for p, f in got.items() if f.link is not None} == {
        "/app/rel": "data.txt",
        "/app/abs": "/etc/os-release",
        "/app/sub/out": "../../../../etc/shadow",
        "/app/dangling": "nowhere",
    }
    assert all(f.data == b"" and f.mode == 0o777 for f in got.values() if f.link is not None)
    assert got["/app/hard"].link is None and got["/app/hard"].data == b"hello\n"


def test_links_cross_the_wire_and_change_the_layer_key():
    def spec(target: str) -> templatespec.TemplateSpec:
        item = templatespec.FileItem("/app/l", b"", link=target)
        return templatespec.TemplateSpec("links", "base", (templatespec.Step("files", files=(item,)),))

    a = spec("data.txt")
    assert templatespec.from_wire(a.to_wire()) == a
    assert templatespec.step_keys(a, "k") != templatespec.step_keys(spec("other.txt"), "k")
    plain = templatespec.FileItem("/app/f", b"x")
    assert (
        "link"
        not in templatespec.TemplateSpec(
            "p", "base", (templatespec.Step("files", files=(plain,)),)
        ).to_wire()["steps"][0]["files"][0]
    )  # specs without links: wire (and keys) as before


@pytest.mark.parametrize(
    "members, words",
    [
        ([("d", b"", "sym", "/etc"), ("d/x", b"x", "file", "")], "symbolic link d and d/x"),
        ([("h", b"", "hard", "missing")], "hard link 'h' names 'missing'"),
        ([("h", b"", "hard", "/etc/shadow")], "hard link 'h' names '/etc/shadow'"),
        ([("d/x", b"x", "file", ""), ("h", b"", "hard", "d")], "hard link 'h' names 'd'"),  # a directory
        ([("h", b"", "hard", "later"), ("later", b"x", "file", "")], "hard link 'h' names 'later'"),
        ([("p", b"", "fifo", "")], "device or a FIFO"),
    ],
)
def test_what_cannot_be_kept_is_refused_naming_it(members, words):
    with pytest.raises(errors.InvalidRequest, match=words):
        _files(_tar(("Dockerfile", DOCKERFILE, "file", ""), *members))


def test_a_hard_link_to_a_symbolic_link_is_that_link_never_followed():
    """A tester's context: `s -> /etc/shadow` and `h` a hard link to `s` answered 500 (tarfile
    followed s to resolve h); with `s -> f` inside the context, h silently became a copy of f."""
    got = _files(
        _tar(
            ("Dockerfile", DOCKERFILE, "file", ""),
            ("f", b"data\n", "file", ""),
            ("s", b"", "sym", "/etc/shadow"),
            ("h", b"", "hard", "s"),
            ("t", b"", "sym", "f"),
            ("./sub/g", b"", "hard", "./t"),  # names as tar -C DIR . writes them
            ("h2", b"", "hard", "h"),  # a hard link to a hard link: the same inode
        )
    )
    links = {p: f.link for p, f in got.items() if f.link is not None}
    assert links == {
        "/app/s": "/etc/shadow",
        "/app/h": "/etc/shadow",
        "/app/h2": "/etc/shadow",
        "/app/t": "f",
        "/app/sub/g": "f",
    }
    assert got["/app/f"].data == b"data\n" and got["/app/f"].link is None


def test_hard_links_count_against_the_unpacked_size_each_time(monkeypatch):
    monkeypatch.setattr(routes_templates, "MAX_CONTEXT_FILES_BYTES", 1000)
    big = ("big", b"x" * 400, "file", "")
    routes_templates._context(_tar(("Dockerfile", DOCKERFILE, "file", ""), big, ("h", b"", "hard", "big")))
    with pytest.raises(errors.PayloadTooLarge, match="'h2' alone is 400"):
        routes_templates._context(
            _tar(
                ("Dockerfile", DOCKERFILE, "file", ""),
                big,
                ("h", b"", "hard", "big"),
                ("h2", b"", "hard", "h"),  # size 0 in its header: counted as what it copies
            )
        )


def test_a_dockerfile_that_is_a_link_is_refused():
    with pytest.raises(errors.InvalidRequest, match="Dockerfile is a symbolic link"):
        routes_templates._context(_tar(("real", DOCKERFILE, "file", ""), ("Dockerfile", b"", "sym", "real")))


def test_the_worker_writes_links_as_links_and_never_through_one(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    store = layers.LayerStore(str(tmp_path / "templates"))

    async def write(items):
        async with store.making("k") as fs:
            assert fs is not None
            await store.files_layer(fs, items, [])
            links = {
                p: os.readlink(os.path.join(fs, p))
                for p in ("app/out", "app/rel")
                if os.path.islink(os.path.join(fs, p))
            }
            planted = os.path.join(fs, str(victim).lstrip("/"), "planted")
            return links, os.path.exists(planted)

    out = templatespec.FileItem("/app/out", b"", link=str(victim))
    rel = templatespec.FileItem("/app/rel", b"", link="../data")
    assert asyncio.run(write([out, rel])) == ({"app/out": str(victim), "app/rel": "../data"}, False)
    # a spec never has a path below one of its links; given one, the worker follows the link
    # inside the image's root (Docker's way), never on the host
    below = templatespec.FileItem("/app/out/planted", b"owned")
    assert asyncio.run(write([out, below])) == ({"app/out": str(victim)}, True)
    assert os.listdir(victim) == []
    etc = templatespec.FileItem("/etc", b"", link=str(victim))
    with pytest.raises(layers.BadLayer):
        asyncio.run(write([etc]))
