"""The code interpreter service's pure parts (atoll.guest.interpreter): Jupyter IOPub messages to
the NDJSON lines e2b_code_interpreter parses (docs/e2b-compat.md §5), and env vars set for one execution."""

from __future__ import annotations

from atoll.guest import interpreter as it


def test_streams_become_stdout_and_stderr_lines_with_a_timestamp():
    assert it.lines_of("stream", {"name": "stdout", "text": "hi\n"}, 7) == [
        {"type": "stdout", "text": "hi\n", "timestamp": 7}
    ]
    assert it.lines_of("stream", {"name": "stderr", "text": "e"}, 8)[0]["type"] == "stderr"
    assert it.lines_of("stream", {"name": "other", "text": "x"}, 8) == []


def test_execute_result_is_the_main_result_and_display_data_is_not():
    data = {"text/plain": "2", "text/html": "<b>2</b>", "application/vnd.custom": {"a": 1}}
    (line,) = it.lines_of("execute_result", {"data": data, "execution_count": 2}, 0)
    assert line == {
        "type": "result",
        "is_main_result": True,
        "text": "2",
        "html": "<b>2</b>",
        "extra": {"application/vnd.custom": {"a": 1}},
    }
    (shown,) = it.lines_of("display_data", {"data": {"image/png": "iVBOR\n", "text/plain": "<Figure>"}}, 0)
    assert shown["is_main_result"] is False and shown["png"] == "iVBOR" and shown["text"] == "<Figure>"


def test_every_mime_field_the_sdk_reads_is_mapped():
    data = {mime: "v" for mime in it.MIME_FIELDS if mime != "application/json"}
    data["application/json"] = {"k": 1}
    line = it.result_of(data, True)
    for field in ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "javascript"):
        assert line[field] == "v", field
    assert line["json"] == {"k": 1} and "extra" not in line
    assert it.result_of({"application/json": [1]}, True)["extra"] == {"application/json": [1]}


def test_an_error_has_name_value_and_one_traceback_string_without_colour_codes():
    content = {
        "ename": "ZeroDivisionError",
        "evalue": "division by zero",
        "traceback": ["\x1b[0;31m----> 1\x1b[0m 1/0", "ZeroDivisionError: division by zero"],
    }
    assert it.lines_of("error", content, 0) == [
        {
            "type": "error",
            "name": "ZeroDivisionError",
            "value": "division by zero",
            "traceback": "----> 1 1/0\nZeroDivisionError: division by zero",
        }
    ]


def test_execute_input_counts_executions_and_status_says_nothing():
    assert it.lines_of("execute_input", {"execution_count": 3, "code": "x"}, 0) == [
        {"type": "number_of_executions", "execution_count": 3}
    ]
    assert it.lines_of("execute_input", {"code": "x"}, 0) == []
    assert it.lines_of("status", {"execution_state": "busy"}, 0) == []


def test_env_vars_are_set_for_one_execution_and_the_old_values_come_back():
    environ = {"ATOLL_IT_OLD": "before", "OTHER": "kept"}
    saved = it.set_env(environ, {"ATOLL_IT_OLD": "during", "ATOLL_IT_NEW": "x'\"\\"})
    assert environ == {"ATOLL_IT_OLD": "during", "ATOLL_IT_NEW": "x'\"\\", "OTHER": "kept"}
    it.restore_env(environ, saved)
    assert environ == {"ATOLL_IT_OLD": "before", "OTHER": "kept"}
    it.restore_env(environ, it.set_env(environ, {}))
    assert environ == {"ATOLL_IT_OLD": "before", "OTHER": "kept"}
