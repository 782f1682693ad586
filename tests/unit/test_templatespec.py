"""User template build specs (core.templatespec): the JSON shape, the data model, the wire form the
worker receives, and the layer keys a rebuild reuses. The Dockerfile subset is test_dockerfile's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from atoll.core import errors
from atoll.core import templatespec as ts


def refused(fn, *args, says: str | tuple[str, ...] = (), **kwargs) -> str:
    """Call fn, expect InvalidRequest whose message holds every `says` fragment; return the message."""
    with pytest.raises(errors.InvalidRequest) as info:
        fn(*args, **kwargs)
    message = info.value.message
    for fragment in (says,) if isinstance(says, str) else says:
        assert fragment in message, message
    assert info.value.code == "invalid_request" and info.value.status == 400
    return message


def req(**body):
    return ts.from_request({"name": "app", **body})


# --- the JSON shape ---------------------------------------------------------------------------


def test_minimal_request_is_built_from_base_with_no_steps():
    spec = ts.from_request({"name": "app"})
    assert spec == ts.TemplateSpec("app", "base")
    assert spec.from_kind == "base" and spec.oci_path is None
    assert (spec.steps, spec.env, spec.workdir, spec.user, spec.start, spec.ready) == (
        (),
        (),
        None,
        None,
        None,
        None,
    )


def test_full_request_makes_steps_in_order_with_the_spec_settings():
    spec = ts.from_request(
        {
            "name": "py-tools",
            "from": "base",
            "run": ["echo one", "echo two"],
            "files": {"/etc/motd": "hi\n", "/app/b.txt": "b", "/app/a.txt": "ä"},
            "pip": ["requests>=2.31", "uvicorn[standard]==0.30.*"],
            "apt": ["jq", "curl=7.88.1-10+deb12u5"],
            "env": {"MODE": "prod", "A_1": ""},
            "workdir": "/app",
            "user": "app",
            "start": "python -m http.server 8000",
            "ready": {"port": 8000, "timeout_s": 30},
        }
    )
    assert [s.kind for s in spec.steps] == ["apt", "pip", "files", "run", "run"]
    apt, pip, files, run1, run2 = spec.steps
    assert apt.packages == ("jq", "curl=7.88.1-10+deb12u5")
    assert pip.packages == ("requests>=2.31", "uvicorn[standard]==0.30.*")
    assert [f.path for f in files.files] == ["/app/a.txt", "/app/b.txt", "/etc/motd"]
    assert files.files[0].data == "ä".encode() and files.files[0].mode == 0o644
    assert (run1.command, run2.command) == ("echo one", "echo two")
    env = (("A_1", ""), ("MODE", "prod"))
    assert spec.env == env
    for step in spec.steps:
        assert step.env == env and step.workdir == "/app"
    assert [s.user for s in spec.steps] == ["root"] * 5  # `run` may create the user: root
    assert (spec.workdir, spec.user, spec.start) == ("/app", "app", "python -m http.server 8000")
    assert spec.ready == ts.Ready(port=8000, timeout_s=30.0)


def test_run_steps_run_as_root_and_in_slash_without_user_and_workdir():
    spec = req(run="make install", apt=["make"])
    assert [(s.kind, s.user, s.workdir) for s in spec.steps] == [("apt", "root", "/"), ("run", "root", "/")]
    assert spec.steps[1].command == "make install"  # one string is one command


def test_null_values_mean_not_given():
    assert req(**{"from": None, "apt": None, "run": None, "env": None, "ready": None}) == ts.TemplateSpec(
        "app", "base"
    )


def test_empty_lists_make_no_steps():
    assert req(apt=[], pip=[], run=[], files={}).steps == ()


def test_name_from_argument_body_or_both():
    assert ts.from_request({}, name="app").name == "app"
    assert ts.from_request({"name": "app"}, name="app").name == "app"
    assert ts.from_request({"name": "app"}).name == "app"
    refused(ts.from_request, {"name": "one"}, name="two", says=("'one'", "'two'"))
    refused(ts.from_request, {}, says="no name")


@pytest.mark.parametrize("name", ["App", "-app", "a_b", "a.b", "", "a" * 64, "a b", "ä"])
def test_bad_names(name):
    refused(ts.from_request, {"name": name}, says=("is not a template name", "lowercase"))


def test_longest_name_and_digits_first():
    assert req(name="a" * 63).name == "a" * 63
    assert ts.from_request({"name": "9lives"}).name == "9lives"


def test_name_base_is_the_builtin():
    refused(ts.from_request, {"name": "base"}, says=("built-in", "choose another"))


def test_name_of_wrong_type():
    refused(ts.from_request, {"name": 7}, says=("name must be a string", "int"))


def test_from_template_and_oci_archive():
    spec = req(**{"from": "py-base"})
    assert (spec.from_kind, spec.oci_path) == ("template", None)
    spec = req(**{"from": "oci-archive:/srv/images/app.tar"})
    assert (spec.from_kind, spec.oci_path) == ("oci-archive", "/srv/images/app.tar")


@pytest.mark.parametrize(
    "value, says",
    [
        ("python:3.12", "neither a template name"),
        ("Ubuntu", "neither a template name"),
        (3, "neither a template name"),
        ("oci-archive:relative.tar", "absolute"),
        ("oci-archive:/a/../b.tar", "'..'"),
        ("oci-archive:/a//b.tar", "normalised"),
        ("oci-archive:/", "may not be /"),
        ("oci-archive:/a\0b", "NUL"),
    ],
)
def test_bad_from(value, says):
    refused(req, **{"from": value}, says=says)


def test_a_template_cannot_be_built_from_itself():
    refused(req, **{"from": "app"}, says="from itself")


def test_unknown_keys_are_named_with_the_accepted_ones():
    message = refused(req, packages=["jq"], cmd="x", says=("cmd, packages", "the accepted keys are"))
    for key in ts.REQUEST_KEYS:
        assert key in message


def test_body_must_be_an_object():
    refused(ts.from_request, ["name"], says=("JSON object", "list"))


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("apt", "jq", "apt must be a list of package names, got str 'jq'"),
        ("pip", "requests", "pip must be a list of requirements, got str"),
        ("apt", [1], "must be a list of strings"),
        ("files", ["/a"], "files must be an object"),
        ("env", ["A=1"], "env must be an object"),
        ("run", 3, "run must be a list of shell commands"),
        ("ready", 8000, "ready must be an object"),
        ("workdir", 5, "workdir must be a string"),
        ("start", ["python"], "start must be a string"),
        ("user", 1000, "is not a user name"),
    ],
)
def test_type_errors_say_what_was_expected(key, value, says):
    refused(req, **{key: value}, says=says)


@pytest.mark.parametrize(
    "package", ["jq", "g++", "libssl3", "python3.11", "lib32z1-dev", "jq=1.6-2.1", "x1=2:1.0~rc1"]
)
def test_apt_packages_accepted(package):
    assert req(apt=[package]).steps[0].packages == (package,)


@pytest.mark.parametrize(
    "package", ["j", "JQ", "-jq", "jq;rm -rf /", "jq curl", "jq=", "jq=1 2", "jq\n", "jq/bookworm"]
)
def test_bad_apt_packages(package):
    refused(req, apt=[package], says=("not a Debian package name", "e.g. 'jq'"))


def test_too_many_apt_packages():
    refused(
        req, apt=[f"p{i}" for i in range(ts.MAX_PACKAGES + 1)], says=(f"more than {ts.MAX_PACKAGES}", "split")
    )
    assert len(req(apt=[f"p{i}" for i in range(ts.MAX_PACKAGES)]).steps[0].packages) == ts.MAX_PACKAGES


@pytest.mark.parametrize(
    "requirement",
    ["requests", "Django>=4,<5", "uvicorn[standard]", "numpy ~= 1.26", "a_b.c-d!=1.0", "torch==2.3.0+cpu"],
)
def test_pip_requirements_accepted(requirement):
    assert req(pip=[requirement]).steps[0].packages == (requirement,)


@pytest.mark.parametrize(
    "requirement, says",
    [
        ("-e .", "is an option"),
        ("--index-url=https://evil", "is an option"),
        ("-r requirements.txt", "is an option"),
        ("requests\n--extra-index-url x", "line break"),
        ("requests\0", "NUL"),
        ("a" * 201, "longer than 200"),
        ("pkg @ https://example.com/pkg.whl", "no URLs"),
        ("requests; python_version<'3.12'", "no URLs or environment markers"),
        ("", "not a requirement"),
        ("$(reboot)", "not a requirement"),
    ],
)
def test_bad_pip_requirements(requirement, says):
    refused(req, pip=[requirement], says=says)


def test_too_many_pip_requirements():
    refused(req, pip=[f"p{i}" for i in range(ts.MAX_PACKAGES + 1)], says="more than 200")


@pytest.mark.parametrize(
    "run, says",
    [
        ([""], "run[0] is empty"),
        (["   "], "blank"),
        (["echo a", "echo \0"], "run[1] contains a NUL"),
        (["x" * (ts.MAX_COMMAND + 1)], f"more than {ts.MAX_COMMAND}"),
        (["echo \ud800"], "lone surrogate"),
        ([None], "run[0] must be a string, got null"),
        (["true"] * (ts.MAX_RUN + 1), "join some with '&&'"),
    ],
)
def test_bad_run(run, says):
    refused(req, run=run, says=says)


def test_longest_run_list_and_command():
    spec = req(run=["x" * ts.MAX_COMMAND] + ["true"] * (ts.MAX_RUN - 1))
    assert len(spec.steps) == ts.MAX_RUN


@pytest.mark.parametrize(
    "path, says",
    [
        ("etc/motd", "absolute"),
        ("/", "may not be /"),
        ("/a/../etc/shadow", "'..'"),
        ("/a//b", "write '/a/b'"),
        ("/a/./b", "write '/a/b'"),
        ("/a/", "write '/a'"),
        ("/a\0", "NUL"),
        ("/" + "a" * 256, "longer than 255 bytes"),
        ("/" + "a/" * 2048 + "b", "more than 4096"),
    ],
)
def test_bad_file_paths(path, says):
    refused(req, files={path: "x"}, says=says)


def test_file_content_must_be_text():
    refused(req, files={"/a": b"x"}, says=("files /a must be a string", "bytes"))
    refused(req, files={"/a": 5}, says="files /a must be a string")


def test_file_and_directory_at_once():
    refused(req, files={"/app": "x", "/app/main.py": "y"}, says=("both /app and /app/main.py", "drop one"))


def test_file_limits():
    refused(req, files={f"/f{i}": "" for i in range(ts.MAX_FILES + 1)}, says=f"more than {ts.MAX_FILES}")
    half = "x" * (ts.MAX_FILE_BYTES // 2)
    refused(req, files={"/a": half, "/b": half, "/c": "y"}, says=("more than 16777216", "run step"))
    assert len(req(files={"/a": half, "/b": half}).steps[0].files) == 2


def test_empty_file_is_fine():
    assert req(files={"/etc/empty": ""}).steps[0].files[0].data == b""


@pytest.mark.parametrize(
    "env, says",
    [
        ({"1A": "x"}, "is not a variable name"),
        ({"A-B": "x"}, "is not a variable name"),
        ({"": "x"}, "is not a variable name"),
        ({"A": 1}, "env A must be a string"),
        ({"A": None}, "env A must be a string"),
        ({"A": "x\0y"}, "env A contains a NUL"),
        ({"A": "x" * (ts.MAX_ENV_VALUE + 1)}, "more than"),
        ({f"V{i}": "" for i in range(ts.MAX_ENV + 1)}, "set fewer"),
        # a tester's PATHs: accepted, then the build failed with "runsc run failed (exit 128)"
        (
            {"PATH": "/usr/bin\n/bin"},
            ("env: PATH '/usr/bin\\n/bin'", "control character '\\n' (at position 8)"),
        ),
        ({"PATH": "/usr/bin:/bin\t"}, ("env: PATH", "control character '\\t'", "remove it")),
        ({"PATH": "/bin\x7f"}, ("env: PATH", "control character '\\x7f'")),
        ({"PATH": ""}, ("env: PATH ''", "no absolute directory")),
    ],
)
def test_bad_env(env, says):
    refused(req, env=env, says=says)


def test_a_path_of_absolute_directories_is_kept_even_if_they_do_not_exist():
    """The sandbox's agent starts by its own absolute path: a PATH that names no existing directory
    only fails the commands that rely on it, so it is the template's to choose."""
    assert dict(req(env={"PATH": "/nonexistent"}).env) == {"PATH": "/nonexistent"}
    assert (
        dict(req(env={"PATH": "./node_modules/.bin:/usr/bin"}).env)["PATH"] == "./node_modules/.bin:/usr/bin"
    )


@pytest.mark.parametrize(
    "workdir, says", [("app", "absolute"), ("/app/", "write '/app'"), ("/a/../b", "'..'"), ("", "empty")]
)
def test_bad_workdir(workdir, says):
    refused(req, workdir=workdir, says=says)


def test_workdir_may_be_root():
    assert req(workdir="/").workdir == "/"


@pytest.mark.parametrize("user", ["app", "_svc", "www-data", "a" * 32, "1000", "0"])
def test_users_accepted(user):
    spec = req(user=user, run=["id"])
    assert spec.user == user and spec.steps[0].user == "root"


@pytest.mark.parametrize("user", ["App", "-x", "a" * 33, "a b", "", "root:root", "1000a"])
def test_bad_users(user):
    refused(req, user=user, says=("is not a user name", "e.g. 'app'"))


@pytest.mark.parametrize("start, says", [("", "empty"), ("  ", "blank"), ("a\0", "NUL")])
def test_bad_start(start, says):
    refused(req, start=start, says=says)


def test_ready_forms():
    assert req(ready={"cmd": "curl -sf localhost:8000"}).ready == ts.Ready(cmd="curl -sf localhost:8000")
    assert req(ready={"port": 1, "timeout_s": 1800}).ready == ts.Ready(port=1, timeout_s=1800.0)
    assert req(start="srv", ready={"port": 65535, "timeout_s": 1.5}).ready.timeout_s == 1.5
    assert req(ready={"port": 80}).start is None  # a check of the snapshot moment


@pytest.mark.parametrize(
    "ready, says",
    [
        ({}, "exactly one of port and cmd"),
        ({"port": 80, "cmd": "true"}, "exactly one of port and cmd"),
        ({"port": 0}, "1-65535"),
        ({"port": 65536}, "1-65535"),
        ({"port": "80"}, "1-65535"),
        ({"port": True}, "1-65535"),
        ({"cmd": ""}, "ready.cmd is empty"),
        ({"cmd": "a\0"}, "NUL"),
        ({"port": 80, "timeout_s": 0.5}, "from 1 to 1800"),
        ({"port": 80, "timeout_s": 1801}, "from 1 to 1800"),
        ({"port": 80, "timeout_s": "10"}, "from 1 to 1800"),
        ({"port": 80, "timeout_s": float("nan")}, "from 1 to 1800"),
        ({"port": 80, "timeout_s": True}, "from 1 to 1800"),
        ({"port": 80, "path": "/health"}, ("unknown keys path", "port, cmd, timeout_s")),
    ],
)
def test_bad_ready(ready, says):
    refused(req, ready=ready, says=says)


def test_long_values_are_cut_in_messages():
    message = refused(req, apt=["X" * 5000])
    assert len(message) < 400 and "..." in message


# --- the data model ---------------------------------------------------------------------------


def test_dataclasses_validate_themselves():
    refused(ts.FileItem, "/a", b"", 0o10000, says="0 to 0o7777")
    refused(ts.FileItem, "/a", b"", -1, says="0 to 0o7777")
    refused(ts.FileItem, "/a", "text", says="must be bytes")
    assert ts.FileItem("/a", bytearray(b"x"), 0o7777).data == b"x"  # type: ignore[arg-type]
    refused(ts.Step, "docker", says=("unknown", "apt, pip, run, files"))
    refused(ts.Step, "apt", says="at least one package")
    refused(ts.Step, "files", says="at least one file")
    refused(ts.Step, "files", files=3, says="tuple of FileItem")
    refused(ts.Step, "files", files=("/a",), says="FileItem values")
    refused(ts.Step, "run", says="empty")
    refused(ts.Step, "run", command="true", packages=("jq",), says="takes no packages")
    refused(ts.Step, "apt", packages=("jq",), command="x", says="takes no command")
    refused(ts.Step, "run", command="x", files=(ts.FileItem("/a", b""),), says="takes no files")
    refused(ts.Step, "apt", packages=("jq",), user="app", says="run as root")
    refused(ts.Step, "files", files=(ts.FileItem("/a", b""),), user="app", says="run as root")
    refused(ts.Step, "files", files=(ts.FileItem("/b", b""), ts.FileItem("/a", b"")), says="sorted")
    refused(ts.Step, "files", files=(ts.FileItem("/a", b""), ts.FileItem("/a", b"")), says="twice")
    refused(ts.Step, "run", command="x", workdir="tmp", says="absolute")
    refused(ts.Step, "run", command="x", env=(("A", "1"), ("A", "2")), says="sets A twice")
    refused(ts.TemplateSpec, "app", "base", steps=("echo",), says="Step values")
    refused(ts.TemplateSpec, "app", "base", ready={"port": 1}, says="Ready value")
    refused(
        ts.TemplateSpec,
        "app",
        "base",
        steps=(ts.Step("run", command="x"),) * (ts.MAX_STEPS + 1),
        says="merge",
    )


def test_dataclasses_normalise_sequences_and_env():
    step = ts.Step("apt", packages=["jq"], env={"B": "2", "A": "1"})  # type: ignore[arg-type]
    assert step.packages == ("jq",) and step.env == (("A", "1"), ("B", "2"))
    spec = ts.TemplateSpec("app", "base", steps=[step], env=[("Z", ""), ("A", "x")])  # type: ignore[arg-type]
    assert spec.steps == (step,) and spec.env == (("A", "x"), ("Z", ""))
    hash(spec)  # frozen and hashable all the way down


@pytest.mark.parametrize(
    "step, line",
    [
        (ts.Step("apt", packages=("jq", "curl")), "apt install jq curl"),
        (ts.Step("pip", packages=("x",)), "pip install x"),
        (ts.Step("run", command="pip install x"), "RUN pip install x"),
        (ts.Step("run", command="a &&\n   b"), "RUN a && b"),
        (ts.Step("files", files=(ts.FileItem("/etc/motd", b""),)), "COPY /etc/motd"),
        (ts.Step("files", files=tuple(ts.FileItem(f"/f{i}", b"") for i in range(3))), "COPY 3 files"),
    ],
)
def test_describe(step, line):
    assert step.describe() == line


def test_describe_is_one_short_line():
    line = ts.Step("run", command="echo " + "x" * 500 + "\necho y").describe()
    assert len(line) <= 120 and "\n" not in line and line.endswith("...")


# --- the wire form ----------------------------------------------------------------------------


def _rich_spec() -> ts.TemplateSpec:
    return ts.TemplateSpec(
        name="app",
        from_="oci-archive:/srv/img.tar",
        steps=(
            ts.Step("apt", packages=("jq",), env=(("A", "1"),)),
            ts.Step(
                "files",
                files=(ts.FileItem("/bin/tool", b"\x00\xff\x7fELF", 0o755), ts.FileItem("/etc/x", b"")),
                workdir="/srv",
            ),
            ts.Step("run", command="echo 'ä' | tee /x", user="app", workdir="/srv"),
        ),
        env=(("A", "1"), ("B", "")),
        workdir="/srv",
        user="app",
        start="python -m app",
        ready=ts.Ready(cmd="test -e /ready", timeout_s=5),
    )


def test_wire_round_trip_through_json():
    spec = _rich_spec()
    wire = json.loads(json.dumps(spec.to_wire()))
    assert ts.from_wire(wire) == spec
    assert wire["from"] == "oci-archive:/srv/img.tar"
    assert wire["steps"][1]["files"][0] == {"path": "/bin/tool", "data": "AP9/RUxG", "mode": 0o755}
    for spec in (ts.TemplateSpec("x", "base"), req(run="true", ready={"port": 80}), req(files={"/a": "é"})):
        assert ts.from_wire(json.loads(json.dumps(spec.to_wire()))) == spec


def _wire(**changes):
    wire = _rich_spec().to_wire()
    wire.update(changes)
    return wire


def _wire_step(i, **changes):
    wire = _rich_spec().to_wire()
    wire["steps"][i].update(changes)
    return wire


@pytest.mark.parametrize(
    "wire, says",
    [
        ("spec", "must be a JSON object"),
        (_wire(extra=1), "unknown keys extra"),
        ({"from": "base", "steps": []}, "no 'name'"),
        ({"name": "x", "steps": []}, "no 'from'"),
        ({"name": "x", "from": "base"}, "no 'steps'"),
        (_wire(steps={}), "steps must be a list"),
        (_wire(steps=["run"]), "step 0 must be a JSON object"),
        (_wire(name="base"), "built-in"),
        (_wire(env={"1": "x"}), "not a variable name"),
        (_wire(ready={"port": 70000}), "1-65535"),
        (_wire(ready={"port": 1, "x": 2}), "unknown keys x"),
        (_wire_step(0, kind="brew"), "unknown"),
        (_wire_step(0, user="app"), "run as root"),
        (_wire_step(0, packages="jq"), "list of strings"),
        (_wire_step(0, packages=["--pre"]), "not a Debian package"),
        (_wire_step(2, command=""), "empty"),
        (_wire_step(2, workdir="srv"), "absolute"),
        (_wire_step(2, shell="bash"), "unknown keys shell"),
        (_wire_step(1, files={}), "files must be a list"),
        (_wire_step(1, files=[{"path": "/a", "data": "!!!", "mode": 420}]), "not valid base64"),
        (_wire_step(1, files=[{"path": "/a", "data": 5, "mode": 420}]), "base64 string"),
        (_wire_step(1, files=[{"path": "a", "data": "", "mode": 420}]), "absolute"),
        (_wire_step(1, files=[{"path": "/a", "data": "", "mode": 0o20000}]), "0o7777"),
        (_wire_step(1, files=[{"path": "/b", "data": ""}, {"path": "/a", "data": ""}]), "sorted"),
        (_wire_step(1, files=[{"path": "/a", "data": "", "owner": "x"}]), "unknown keys owner"),
    ],
)
def test_from_wire_validates_everything(wire, says):
    refused(ts.from_wire, wire, says=says)


# --- layer and snapshot keys ------------------------------------------------------------------


def test_keys_are_stable_and_short_hex():
    body = {"name": "app", "apt": ["jq"], "files": {"/a": "x"}, "run": ["one", "two"]}
    keys = ts.step_keys(ts.from_request(body), "base-0123")
    assert keys == ts.step_keys(ts.from_request(json.loads(json.dumps(body))), "base-0123")
    assert len(keys) == 4 and len(set(keys)) == 4
    assert all(len(k) == 24 and int(k, 16) >= 0 for k in keys)
    assert ts.step_keys(ts.TemplateSpec("app", "base"), "base-0123") == []


def test_changing_the_last_step_changes_only_the_last_key():
    a = ts.step_keys(req(apt=["jq"], run=["one", "two"]), "b")
    b = ts.step_keys(req(apt=["jq"], run=["one", "three"]), "b")
    assert a[:-1] == b[:-1] and a[-1] != b[-1]


def test_a_change_changes_its_key_and_every_key_above():
    a = ts.step_keys(req(apt=["jq"], files={"/a": "x"}, run=["one"]), "b")
    b = ts.step_keys(req(apt=["jq"], files={"/a": "y"}, run=["one"]), "b")
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


@pytest.mark.parametrize(
    "change",
    [
        {"env": {"A": "2"}},
        {"workdir": "/srv"},
    ],
)
def test_env_and_workdir_change_every_key(change):
    base = {"apt": ["jq"], "run": ["one"], "env": {"A": "1"}}
    a = ts.step_keys(req(**base), "b")
    b = ts.step_keys(req(**{**base, **change}), "b")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_user_changes_no_step_key_and_name_changes_none():
    a = ts.step_keys(req(apt=["jq"], run=["one"]), "b")
    b = ts.step_keys(req(apt=["jq"], run=["one"], user="app"), "b")
    assert a == b  # steps run as root either way; the user is the sandboxes' (the snapshot's key)
    assert ts.snapshot_key(req(run=["one"]), a[1]) != ts.snapshot_key(req(run=["one"], user="app"), a[1])
    other = ts.from_request({"name": "other", "apt": ["jq"], "run": ["one"]})
    assert ts.step_keys(other, "b") == a  # same content, same layers: shared by both templates


def test_base_key_and_file_mode_are_in_the_keys():
    spec = req(run=["one"])
    assert ts.step_keys(spec, "b1") != ts.step_keys(spec, "b2")
    one = ts.TemplateSpec("app", "base", (ts.Step("files", files=(ts.FileItem("/x", b"1", 0o644),)),))
    two = ts.TemplateSpec("app", "base", (ts.Step("files", files=(ts.FileItem("/x", b"1", 0o755),)),))
    assert ts.step_keys(one, "b") != ts.step_keys(two, "b")


def test_a_files_step_key_names_its_layout_and_other_steps_keys_do_not(monkeypatch):
    """Layers a files step made before its paths were resolved through the image's links (a real
    bin/ hiding /bin) are never reused: the layout is in the key, from that step up."""
    spec = req(apt=["jq"], files={"/bin/tool": "x"}, run=["one"])
    now = ts.step_keys(spec, "b")
    monkeypatch.setattr(ts, "FILES_LAYOUT", ts.FILES_LAYOUT - 1)
    before = ts.step_keys(spec, "b")
    assert now[0] == before[0] and now[1] != before[1] and now[2] != before[2]


def test_bad_base_and_layer_keys():
    refused(ts.step_keys, req(), "", says="base_key")
    refused(ts.step_keys, req(), None, says="base_key")
    refused(ts.snapshot_key, req(), "", says="layer_key")


def test_snapshot_key_covers_what_a_booted_sandbox_depends_on():
    spec = req(run=["one"], start="srv", ready={"port": 80})
    top = ts.step_keys(spec, "b")[-1]
    key = ts.snapshot_key(spec, top)
    assert len(key) == 24 and key == ts.snapshot_key(req(run=["one"], start="srv", ready={"port": 80}), top)
    assert key != top and key != ts.snapshot_key(spec, "other-layer")
    variants: list[dict[str, Any]] = [
        {"start": "srv2", "ready": {"port": 80}},
        {"start": "srv", "ready": {"port": 81}},
        {"start": "srv", "ready": {"port": 80, "timeout_s": 60}},
        {"start": "srv"},
        {"start": "srv", "ready": {"port": 80}, "user": "app"},
        {"start": "srv", "ready": {"port": 80}, "workdir": "/srv"},
        {"start": "srv", "ready": {"port": 80}, "env": {"A": "1"}},
    ]
    for v in variants:
        assert ts.snapshot_key(req(run=["one"], **v), top) != key, v
