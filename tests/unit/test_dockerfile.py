"""The Dockerfile subset of user templates (core.dockerfile): instructions, line handling and
directives, word splitting and substitution, COPY/ADD against a build context, and the specs and
keys that come out."""

from __future__ import annotations

import json

import pytest

from atoll.core import dockerfile
from atoll.core import templatespec as ts
from tests.unit.test_templatespec import refused

DEFAULT_PATH = dockerfile.DEFAULT_PATH


def df(text: str, context=None, name: str = "app", **kwargs) -> ts.TemplateSpec:
    return dockerfile.parse(text, name, context, **kwargs)


def ctx(**files) -> dict[str, tuple[bytes, int]]:
    """A build context: path -> content (str or bytes), every file mode 0o644."""
    return {k: (v.encode() if isinstance(v, str) else v, 0o644) for k, v in files.items()}


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
        ('ENV PATH=""', "ENV PATH '' has no absolute directory"),
        ("ENV PATH bin:node_modules/.bin", "ENV PATH 'bin:node_modules/.bin' has no absolute directory"),
        ("ENV PATH=/usr/bin\x01/bin", "ENV PATH '/usr/bin\\x01/bin' contains the control character"),
    ],
)
def test_env_errors(line, says):
    refused(df, f"FROM base\n{line}\n", says=("Dockerfile line 2: ", says))


def test_a_path_that_finds_nothing_names_its_line():
    """A tester's Dockerfile: the PATH error came from the spec at the end, with no line number."""
    refused(
        df,
        'FROM base\nENV A=1\nRUN true\nENV PATH=""\n',
        says=("Dockerfile line 4: ENV PATH '' has no absolute directory", "leave PATH out"),
    )


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
        # merged /usr's links to directories (the worker resolves them: /bin/a.txt is /usr/bin/a.txt)
        "COPY a.txt /bin": ["/bin/a.txt"],
        "COPY a.txt /sbin": ["/sbin/a.txt"],
        "COPY a.txt /lib64": ["/lib64/a.txt"],
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
    refused(df, "FROM base\n" + "#" * dockerfile.MAX_DOCKERFILE, says="more than 1048576")
    text = "FROM base\n" + "RUN true\n" * dockerfile.MAX_DOCKERFILE_STEPS
    assert len(df(text).steps) == dockerfile.MAX_DOCKERFILE_STEPS
    refused(
        df,
        text + "RUN one-too-many\n",
        says=(f"line {dockerfile.MAX_DOCKERFILE_STEPS + 2}", "more than 100 steps"),
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


def test_a_line_that_is_only_a_continuation_is_nothing():
    spec = dockerfile.parse("FROM base\n\\\nRUN true\n", "x")
    assert [s.command for s in spec.steps] == ["true"]
    assert dockerfile.parse("FROM base\n\\\n", "x").steps == ()
