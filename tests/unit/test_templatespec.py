"""User template build specs (core.templatespec): the JSON shape, the Dockerfile subset, the wire
form the worker receives, and the layer keys a rebuild reuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from atoll.core import errors
from atoll.core import templatespec as ts

DEFAULT_PATH = ts.DEFAULT_PATH


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


def df(text: str, context=None, name: str = "app", **kwargs) -> ts.TemplateSpec:
    return ts.parse_dockerfile(text, name, context, **kwargs)


def ctx(**files) -> dict[str, tuple[bytes, int]]:
    """A build context: path -> content (str or bytes), every file mode 0o644."""
    return {k: (v.encode() if isinstance(v, str) else v, 0o644) for k, v in files.items()}


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
    assert [s.user for s in spec.steps] == ["root", "root", "root", "app", "app"]
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
    ],
)
def test_bad_env(env, says):
    refused(req, env=env, says=says)


@pytest.mark.parametrize(
    "workdir, says", [("app", "absolute"), ("/app/", "write '/app'"), ("/a/../b", "'..'"), ("", "empty")]
)
def test_bad_workdir(workdir, says):
    refused(req, workdir=workdir, says=says)


def test_workdir_may_be_root():
    assert req(workdir="/").workdir == "/"


@pytest.mark.parametrize("user", ["app", "_svc", "www-data", "a" * 32, "1000", "0"])
def test_users_accepted(user):
    assert req(user=user, run=["id"]).steps[0].user == user


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


def test_user_changes_run_keys_only_and_name_changes_none():
    a = ts.step_keys(req(apt=["jq"], run=["one"]), "b")
    b = ts.step_keys(req(apt=["jq"], run=["one"], user="app"), "b")
    assert a[0] == b[0] and a[1] != b[1]
    other = ts.from_request({"name": "other", "apt": ["jq"], "run": ["one"]})
    assert ts.step_keys(other, "b") == a  # same content, same layers: shared by both templates


def test_base_key_and_file_mode_are_in_the_keys():
    spec = req(run=["one"])
    assert ts.step_keys(spec, "b1") != ts.step_keys(spec, "b2")
    one = ts.TemplateSpec("app", "base", (ts.Step("files", files=(ts.FileItem("/x", b"1", 0o644),)),))
    two = ts.TemplateSpec("app", "base", (ts.Step("files", files=(ts.FileItem("/x", b"1", 0o755),)),))
    assert ts.step_keys(one, "b") != ts.step_keys(two, "b")


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


# --- Dockerfiles ------------------------------------------------------------------------------

REALISTIC = """\
# syntax=docker/dockerfile:1
# A realistic Dockerfile.
FROM base AS runtime

ENV APP_HOME=/srv/app \\
    GREETING="hello world" \\
    PATH="/srv/venv/bin:$PATH"
ENV LEGACY value with spaces
WORKDIR $APP_HOME

RUN apt-get update && \\
    # comments inside a continuation are dropped
    apt-get install -y --no-install-recommends jq \\

    && rm -rf /var/lib/apt/lists/*
COPY requirements.txt ./
run ["pip", "install", "-r", "requirements.txt"]
COPY src/ ./src
COPY *.py bin/
COPY --chmod=755 scripts/run.sh /usr/local/bin
WORKDIR src
USER app:app
RUN python -c 'print(1)'
ENTRYPOINT ["python", "-m", "app"]
CMD ["--port", "8000"]
"""


def realistic_context():
    return {
        "Dockerfile": (REALISTIC.encode(), 0o644),
        "requirements.txt": (b"requests\n", 0o100644),
        "src/app/__init__.py": (b"", 0o644),
        "src/app/main.py": (b"print('hi')\n", 0o644),
        "main.py": (b"import app\n", 0o644),
        "setup.py": (b"", 0o600),
        "scripts/run.sh": (b"#!/bin/sh\n", 0o644),
        "notes.txt": (b"", 0o644),
    }


def test_realistic_dockerfile():
    spec = df(REALISTIC, realistic_context())
    assert spec.name == "app" and spec.from_ == "base" and spec.ready is None
    env = (
        ("APP_HOME", "/srv/app"),
        ("GREETING", "hello world"),
        ("LEGACY", "value with spaces"),
        ("PATH", "/srv/venv/bin:" + DEFAULT_PATH),
    )
    assert spec.env == env
    assert (spec.workdir, spec.user) == ("/srv/app/src", "app")
    assert spec.start == "python -m app --port 8000"
    kinds = [(s.kind, s.workdir, s.user) for s in spec.steps]
    assert kinds == [
        ("run", "/srv/app", "root"),
        ("files", "/srv/app", "root"),
        ("run", "/srv/app", "root"),
        ("files", "/srv/app", "root"),
        ("files", "/srv/app", "root"),
        ("files", "/srv/app", "root"),
        ("run", "/srv/app/src", "app"),
    ]
    assert all(s.env == env for s in spec.steps)
    apt, req_txt, pip, src, py, script, last = spec.steps
    assert apt.command == (
        "apt-get update &&     apt-get install -y --no-install-recommends jq     && rm -rf /var/lib/apt/lists/*"
    )
    assert [(f.path, f.data, f.mode) for f in req_txt.files] == [
        ("/srv/app/requirements.txt", b"requests\n", 0o644)
    ]
    assert pip.command == "pip install -r requirements.txt"
    assert [f.path for f in src.files] == ["/srv/app/src/app/__init__.py", "/srv/app/src/app/main.py"]
    assert [(f.path, f.mode) for f in py.files] == [
        ("/srv/app/bin/main.py", 0o644),
        ("/srv/app/bin/setup.py", 0o600),
    ]
    assert [(f.path, f.mode) for f in script.files] == [("/usr/local/bin/run.sh", 0o755)]
    assert last.command == "python -c 'print(1)'"
    assert ts.from_wire(json.loads(json.dumps(spec.to_wire()))) == spec


def test_unsupported_instruction_after_a_multi_line_run_names_its_line():
    text = "FROM base\nRUN a && \\\n    b && \\\n\n    # note\n    c\nEXPOSE 8000\n"
    refused(
        df,
        text,
        says=(
            "Dockerfile line 7: EXPOSE is not supported "
            "(atoll supports FROM, RUN, COPY, ADD, ENV, WORKDIR, USER, CMD, ENTRYPOINT)"
        ),
    )


@pytest.mark.parametrize(
    "instruction", ["ARG V=1", "EXPOSE 80", "LABEL a=b", "VOLUME /data", "HEALTHCHECK CMD true", "ONBUILD RUN x",
                    'SHELL ["/bin/bash", "-c"]', "STOPSIGNAL SIGTERM", "MAINTAINER me", "expose 80"],
)  # fmt: skip
def test_every_other_instruction_is_refused_with_its_line(instruction):
    word = instruction.split()[0].upper()
    refused(
        df,
        f"FROM base\n\n# c\n{instruction}\n",
        says=(f"Dockerfile line 4: {word} is not supported", "atoll supports"),
    )


def test_unknown_words_are_refused_with_a_hint():
    refused(
        df,
        "FROM base\nRUN apt-get update\n    && apt-get install jq\n",
        says=("Dockerfile line 3: unknown instruction '&&'", "end that line with \\"),
    )
    refused(df, "FROM base\nCOPYY a b\n", says="line 2: unknown instruction 'COPYY'")


def test_arg_before_from_is_refused_as_arg():
    refused(df, "ARG V=1\nFROM base\n", says="line 1: ARG is not supported")


def test_instructions_are_case_insensitive():
    spec = df("from base\nEnv A=1\nrun echo $A\nworkdir /w\nuser app\ncmd echo hi\n")
    assert spec.steps[0].command == "echo $A" and spec.steps[0].env == (("A", "1"),)
    assert (spec.workdir, spec.user, spec.start) == ("/w", "app", "echo hi")


def test_crlf_bom_tabs_and_trailing_continuation():
    spec = df("\ufeffFROM base\r\nRUN\techo a \\\r\n  b\r\n\r\nRUN echo c \\\n")
    assert [s.command for s in spec.steps] == ["echo a   b", "echo c"]


def test_escape_directive_backtick():
    text = "# escape=`\nFROM base\nRUN echo a `\n  b\nWORKDIR /a`$b\nRUN dir C:\\x\\\n"
    spec = df(text)
    assert [s.command for s in spec.steps] == ["echo a   b", "dir C:\\x\\"]
    assert spec.workdir == "/a$b"


def test_directives_only_count_at_the_top():
    spec = df("# hello\n# escape=`\nFROM base\nRUN a \\\n b\n")  # not a directive: \ still escapes
    assert spec.steps[0].command == "a  b"
    refused(df, "# escape=x\nFROM base\n", says="line 1: escape directive 'x'")
    refused(
        df, "# escape=`\n# escape=\\\nFROM base\n", says="line 2: the escape parser directive is given twice"
    )
    assert df("# foo=1\n# foo=2\nFROM base\n").from_ == "base"  # unknown directives are comments


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "no FROM line"),
        ("# only a comment\n\n", "no FROM line"),
        ("RUN echo\nFROM base\n", "line 1: RUN before FROM"),
        ("\n\nENV A=1\n", "line 3: ENV before FROM"),
        ("FROM base\nRUN x\nFROM base\n", ("line 3: a second FROM", "multi-stage")),
        (
            "FROM python:3.12\n",
            ("line 1: FROM 'python:3.12' looks like a registry image", "oci-archive:", "future work"),
        ),
        ("FROM docker.io/library/ubuntu\n", "no registry"),
        ("FROM ubuntu@sha256:abc\n", "no registry"),
        ("FROM Ubuntu\n", "is not a template name"),
        ("FROM --platform=linux/amd64 base\n", "line 1: FROM --platform=linux/amd64 is not supported"),
        ("FROM base AS\n", "takes one image"),
        ("FROM base x y\n", "takes one image"),
        ("FROM\n", "takes one image"),
        ("FROM app\n", "line 1: template 'app' cannot be built FROM itself"),
        ("FROM oci-archive:img.tar\n", ("line 1", "absolute")),
    ],
)
def test_from_errors(text, says):
    refused(df, text, says=says)


def test_from_forms():
    assert df("FROM base as build\n").from_ == "base"
    assert df("FROM ubuntu\n").from_kind == "template"  # a template name; the server answers if unknown
    spec = df("FROM oci-archive:/srv/images/py.tar AS py\n")
    assert (spec.from_kind, spec.oci_path) == ("oci-archive", "/srv/images/py.tar")
    refused(df, "FROM base\n", name="base", says="built-in")


def test_run_forms():
    spec = df('FROM base\nRUN ["sh", "-c", "echo $HOME; ls \'a b\'"]\nRUN [not json\nRUN ["a", 1]\n')
    assert [s.command for s in spec.steps] == [
        "sh -c 'echo $HOME; ls '\"'\"'a b'\"'\"''",
        "[not json",
        '["a", 1]',
    ]


@pytest.mark.parametrize(
    "line, says",
    [
        ("RUN --mount=type=cache,target=/root/.cache pip install x", "line 2: RUN --mount is not supported"),
        ("RUN --network=none make", "RUN --network is not supported"),
        ("RUN", "line 2: RUN needs a command"),
        ("RUN []", "RUN needs a command"),
        ("RUN cat <<EOF > /x", "line 2: heredocs (<<EOF) are not supported"),
        ("RUN <<'EOT' bash", "heredocs"),
        ('RUN ["echo", "\\u0000"]', "NUL"),
    ],
)
def test_run_errors(line, says):
    refused(df, f"FROM base\n{line}\n", says=says)


def test_shell_operators_that_are_not_heredocs():
    spec = df("FROM base\nRUN echo $((1<<2)) && cat <<<hi\n")
    assert spec.steps[0].command == "echo $((1<<2)) && cat <<<hi"


def test_env_forms_and_substitution():
    spec = df(
        "FROM base\n"
        "ENV A=1 B=$A C=${A:-x}\n"  # all substituted from the env before the line (Docker)
        "ENV D=$A E=${A}2 F='$A' G=\"$A $B\" H=a\\ b I=\\$A J=\n"
        "ENV K=${UNSET:-dflt} L=${A:+alt} M=${UNSET:+alt} N=${EMPTY-dash} O=${J:-colon} P=${J-nocolon}\n"
        'ENV Q="a\\"b\\\\c\\d" R=${UNSET}x S=$ T=a$-b\n'
    )
    env = dict(spec.env)
    assert (env["A"], env["B"], env["C"]) == ("1", "", "x")
    assert (env["D"], env["E"], env["F"], env["G"], env["H"], env["I"], env["J"]) == (
        "1",
        "12",
        "$A",
        "1 ",
        "a b",
        "$A",
        "",
    )
    assert (env["K"], env["L"], env["M"], env["N"], env["O"], env["P"]) == (
        "dflt",
        "alt",
        "",
        "dash",
        "colon",
        "",
    )
    assert (env["Q"], env["R"], env["S"], env["T"]) == ('a"b\\c\\d', "x", "$", "a$-b")


def test_env_sees_the_inherited_env():
    spec = df("FROM py\nENV PATH=/opt/bin:$PATH HOME2=$HOME\n", inherited_env={"PATH": "/x", "HOME": "/root"})
    assert dict(spec.env) == {"PATH": "/opt/bin:/x", "HOME2": "/root"}
    assert dict(df("FROM base\nENV P=$PATH\n").env) == {"P": DEFAULT_PATH}


def test_env_applies_to_later_steps_only():
    spec = df("FROM base\nRUN one\nENV A=1\nRUN two\nENV A=2\n")
    assert [s.env for s in spec.steps] == [(), (("A", "1"),)]
    assert spec.env == (("A", "2"),)


@pytest.mark.parametrize(
    "line, says",
    [
        ("ENV", "ENV needs NAME=value"),
        ("ENV A", "ENV A has no value"),
        ("ENV A=1 B", "ENV 'B' is not NAME=value"),
        ("ENV 1A=x", "ENV name '1A' is not a variable name"),
        ("ENV A='x", "unterminated single quote"),
        ('ENV A="x', "unterminated double quote"),
        ("ENV A=${B", "unterminated ${...}"),
        ("ENV A=${B:-x", "unterminated ${...}"),
        ("ENV A=${}", "needs a variable name"),
        ("ENV A=${B/x/y}", "unsupported substitution"),
        ('ENV A="${UNSET:?set it please}"', "UNSET is not set: set it please"),
        ("ENV A=${UNSET:?set it please}", "unterminated ${...}"),  # words split at spaces first
        ("ENV A=${UNSET?}", "UNSET is not set"),
    ],
)
def test_env_errors(line, says):
    refused(df, f"FROM base\n{line}\n", says=("Dockerfile line 2: ", says))


def test_required_variable_that_is_set():
    assert dict(df("FROM base\nENV A=1\nENV B=${A:?x}\n").env)["B"] == "1"


def test_workdir_relative_absolute_and_substituted():
    spec = df('FROM base\nWORKDIR /a\nWORKDIR b\nRUN x\nWORKDIR ../c/./d/\nENV W=/w\nWORKDIR "$W/e f"\n')
    assert spec.steps[0].workdir == "/a/b"
    assert spec.workdir == "/w/e f"
    assert df("FROM base\nWORKDIR ../../x\n").workdir == "/x"
    assert df("FROM base\nRUN x\n").workdir is None
    refused(df, "FROM base\nWORKDIR\n", says="line 2: WORKDIR needs a path")
    refused(df, 'FROM base\nWORKDIR ""\n', says="line 2: WORKDIR needs a path")


def test_user_forms():
    assert df("FROM base\nUSER 1000:1000\n").user == "1000"
    assert df("FROM base\nENV U=svc\nUSER $U\n").user == "svc"
    assert df("FROM base\nRUN x\n").user is None
    refused(df, "FROM base\nUSER Root\n", says="line 2: USER 'Root' is not a user name")
    refused(df, "FROM base\nUSER\n", says="line 2: USER '' is not a user name")


@pytest.mark.parametrize(
    "lines, start",
    [
        ("CMD python app.py", "python app.py"),
        ('CMD ["python", "app.py", "a b"]', "python app.py 'a b'"),
        ('ENTRYPOINT ["tini", "--"]\nCMD ["srv"]', "tini -- srv"),
        ('CMD ["srv"]\nENTRYPOINT ["tini", "--"]', "tini -- srv"),
        ('ENTRYPOINT ["tini", "--"]\nCMD srv --port 80', "tini -- /bin/sh -c 'srv --port 80'"),
        ('ENTRYPOINT ["srv"]', "srv"),
        ("ENTRYPOINT srv -x\nCMD ignored", "srv -x"),
        ("CMD first\nCMD second", "second"),
        ('ENTRYPOINT ["a"]\nENTRYPOINT ["b"]\nCMD ["c"]', "b c"),
        ('CMD ["x"]\nCMD []', None),
        ('ENTRYPOINT ["a"]\nENTRYPOINT []\nCMD run it', "run it"),
        ("", None),
    ],
)
def test_start_command(lines, start):
    assert df(f"FROM base\n{lines}\n").start == start


def test_cmd_errors():
    refused(df, "FROM base\nCMD\n", says="line 2: CMD needs a command")
    refused(df, "FROM base\nENTRYPOINT\n", says="line 2: ENTRYPOINT needs a command")
    refused(df, 'FROM base\nCMD ["a\\u0000"]\n', says="line 2: CMD contains a NUL")


def test_copy_file_destinations():
    c = ctx(**{"a.txt": "a"})
    cases = {
        "COPY a.txt /opt/b.txt": ["/opt/b.txt"],
        "COPY a.txt /opt/": ["/opt/a.txt"],
        "COPY a.txt /opt": ["/opt/a.txt"],  # a directory every image has
        "COPY a.txt /usr/local/bin": ["/usr/local/bin/a.txt"],
        "COPY a.txt /app": ["/app"],  # not known to be a directory: the file's new path
        "COPY a.txt .": ["/a.txt"],
        "COPY ./a.txt ./x/../y.txt": ["/y.txt"],
        'COPY ["a.txt", "/with space/"]': ["/with space/a.txt"],
        "COPY \"a.txt\" '/q/'": ["/q/a.txt"],
        "ENV D=/d\nCOPY a.txt ${D}/": ["/d/a.txt"],
        "ENV S=a\nCOPY $S.txt /s/": ["/s/a.txt"],
        "WORKDIR /app\nCOPY a.txt /app": ["/app/a.txt"],  # WORKDIR made it a directory
        "WORKDIR /app\nCOPY a.txt b.txt": ["/app/b.txt"],
        "COPY a.txt /d/\nCOPY a.txt /d": ["/d/a.txt"],  # an earlier COPY made /d a directory
        "COPY --link a.txt /l/": ["/l/a.txt"],
    }
    for lines, paths in cases.items():
        spec = df(f"FROM base\n{lines}\n", c)
        assert [f.path for f in spec.steps[-1].files] == paths, lines


def test_copy_directories_globs_and_the_whole_context():
    c = {
        "Dockerfile": (b"FROM base\n", 0o644),
        "a.py": (b"a", 0o644),
        "b.py": (b"b", 0o755),
        "c.txt": (b"c", 0o644),
        "pkg/x.py": (b"x", 0o644),
        "pkg/sub/y.py": (b"y", 0o644),
    }

    def paths(line):
        return [f.path for f in df(f"FROM base\n{line}\n", c).steps[-1].files]

    assert paths("COPY pkg /app") == ["/app/sub/y.py", "/app/x.py"]  # the contents, not the directory
    assert paths("COPY pkg/ /app/") == ["/app/sub/y.py", "/app/x.py"]
    assert paths("COPY *.py /app") == ["/app/a.py", "/app/b.py"]  # several files: into a directory
    assert paths("COPY p?g/*.py /o/") == ["/o/x.py"]  # a '*' stays within one path component
    assert paths("COPY [ab].py c.txt /m/") == ["/m/a.py", "/m/b.py", "/m/c.txt"]
    assert paths("COPY a.py c.txt /m") == ["/m/a.py", "/m/c.txt"]
    assert paths("COPY . /ctx") == [
        "/ctx/Dockerfile",
        "/ctx/a.py",
        "/ctx/b.py",
        "/ctx/c.txt",
        "/ctx/pkg/sub/y.py",
        "/ctx/pkg/x.py",
    ]
    assert paths("COPY p* /g/") == ["/g/sub/y.py", "/g/x.py"]  # a glob matching a directory
    assert paths("COPY a.py a.py /twice/") == ["/twice/a.py"]
    assert paths("ADD b.py /add/") == ["/add/b.py"]
    files = df("FROM base\nCOPY --chmod=0700 *.py /x/\n", c).steps[0].files
    assert [f.mode for f in files] == [0o700, 0o700]
    assert [f.mode for f in df("FROM base\nCOPY *.py /x/\n", c).steps[0].files] == [0o644, 0o755]


def test_copy_steps_carry_env_and_workdir_but_run_as_root():
    spec = df("FROM base\nENV A=1\nWORKDIR /w\nUSER app\nCOPY a /x\n", ctx(a="1"))
    (step,) = spec.steps
    assert (step.kind, step.env, step.workdir, step.user) == ("files", (("A", "1"),), "/w", "root")


@pytest.mark.parametrize(
    "line, says",
    [
        ("COPY missing.txt /x", "line 2: COPY source 'missing.txt' is not in the build context"),
        ("COPY *.rs /x/", "line 2: COPY source '*.rs' matches nothing"),
        ("COPY ../secret /x", "line 2: COPY source '../secret' is outside the build context"),
        ("COPY a/../../x /x", "outside the build context"),
        ("COPY /etc/passwd /x", "line 2: COPY source '/etc/passwd' is absolute"),
        ("COPY a.txt", "line 2: COPY needs a source and a destination"),
        ("COPY", "needs a source and a destination"),
        ('COPY a.txt ""', "empty destination"),
        ("COPY --from=build /out /out", "line 2: COPY --from is not supported (multi-stage builds)"),
        ("COPY --chown=app:app a.txt /x", ("line 2: COPY --chown is not supported", "RUN chown")),
        ("COPY --chmod=u+x a.txt /x", "--chmod=u+x is not an octal mode"),
        ("COPY --chmod a.txt /x", "is not an octal mode"),
        ("COPY --parents a.txt /x", "COPY --parents is not supported"),
        (
            "ADD https://example.com/x.tgz /x",
            ("line 2: ADD 'https://example.com/x.tgz': ADD does not download", "RUN"),
        ),
        ("ADD git@github.com:a/b.git /x", "ADD does not download"),
        (
            "ADD app.tar.gz /opt/",
            ("line 2: ADD app.tar.gz: archive auto-extraction is not supported", "RUN tar"),
        ),
        ("ADD *.tar /opt/", "archive auto-extraction"),
        ("ADD blob /opt/", "archive auto-extraction"),  # a gzip stream without the suffix
        ('COPY ["a.txt", "/x\\u0000y"]', "line 2: file path contains a NUL"),
        ("COPY a.txt /" + "x" * 256, "longer than 255 bytes"),
    ],
)
def test_copy_errors(line, says):
    c = ctx(**{"a.txt": "a", "app.tar.gz": "x", "b.tar": "y", "blob": b"\x1f\x8b\x08\x00"})
    refused(df, f"FROM base\n{line}\n", c, says=says)


def test_copy_archive_is_fine():
    spec = df("FROM base\nCOPY app.tar.gz /opt/\n", ctx(**{"app.tar.gz": b"\x1f\x8b"}))
    assert spec.steps[0].files[0].path == "/opt/app.tar.gz"


def test_copy_without_a_context_names_the_path():
    refused(
        df, "FROM base\nRUN x\nCOPY app/main.py /app/\n", says=("line 3", "'app/main.py'", "no build context")
    )
    refused(df, "FROM base\nCOPY . /app\n", {}, says="line 2: COPY source '.' is not in the build context")


@pytest.mark.parametrize(
    "context, says",
    [
        ({"/abs": (b"", 0o644)}, "is not a relative normalised path"),
        ({"./a": (b"", 0o644)}, "is not a relative normalised path"),
        ({"a/../b": (b"", 0o644)}, "is not a relative normalised path"),
        ({"a//b": (b"", 0o644)}, "is not a relative normalised path"),
        ({"a/": (b"", 0o644)}, "is not a relative normalised path"),
        ({"": (b"", 0o644)}, "is not a relative normalised path"),
        ({"a": b""}, "must be (content bytes, mode)"),
        ({"a": ("text", 0o644)}, "(content bytes, mode int)"),
        ({"a": (b"", -1)}, "(content bytes, mode int)"),
        ({"a": (b"", "644")}, "(content bytes, mode int)"),
        ({"a": (b"", 0o644), "a/b": (b"", 0o644)}, "both the file a and a/b"),
        ([("a", (b"", 0o644))], "must be a mapping"),
    ],
)
def test_bad_contexts(context, says):
    refused(df, "FROM base\n", context, says=says)


def test_file_limits_across_copies():
    many = {f"d/f{i}": (b"", 0o644) for i in range(600)}
    refused(df, "FROM base\nCOPY d /a\nCOPY d /b\n", many, says=("line 3", "1200 files, more than 1000"))
    big = {"a": (b"x" * (ts.MAX_FILE_BYTES - 10), 0o644), "b": (b"x" * 20, 0o644)}
    refused(df, "FROM base\nCOPY a /a\nCOPY b /b\n", big, says=("line 3", "more than 16777216"))


def test_dockerfile_limits():
    refused(df, "FROM base\n" + "#" * ts.MAX_DOCKERFILE, says="more than 1048576")
    text = "FROM base\n" + "RUN true\n" * ts.MAX_DOCKERFILE_STEPS
    assert len(df(text).steps) == ts.MAX_DOCKERFILE_STEPS
    refused(
        df, text + "RUN one-too-many\n", says=(f"line {ts.MAX_DOCKERFILE_STEPS + 2}", "more than 100 steps")
    )
    refused(df, "FROM base\n\nRUN a\0b\n", says="Dockerfile line 3: a NUL")
    refused(df, b"FROM base\n", says="must be text")
    refused(df, "FROM base\n", name="Bad", says="is not a template name")


def test_dockerfile_keys_change_with_the_copied_content():
    c1, c2 = ctx(**{"a.py": "1", "b.py": "2"}), ctx(**{"a.py": "1", "b.py": "3"})
    text = "FROM base\nRUN setup\nCOPY a.py /app/\nCOPY b.py /app/\nRUN test\n"
    k1, k2 = ts.step_keys(df(text, c1), "b"), ts.step_keys(df(text, c2), "b")
    assert k1[:2] == k2[:2] and k1[2] != k2[2] and k1[3] != k2[3]
    assert ts.step_keys(df(text, c1), "b") == k1
