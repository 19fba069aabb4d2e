"""lrjax.files: one-line errors that name the file."""

import pytest

from lrjax.files import one_line, read_json_object


def test_one_line_keeps_the_first_line_or_the_type():
  assert one_line(ValueError("first\nsecond")) == "first"
  assert one_line(KeyError()) == "KeyError"
  assert one_line(ValueError("x" * 400), limit=10) == "x" * 10


@pytest.mark.parametrize(
  "text, match",
  [
    ("{bad", r"not valid JSON \(.*\); restore it"),
    ("[1, 2]", "expected a JSON object, got list; restore it"),
    ("[" * 100000, r"not valid JSON"),
  ],
)
def test_bad_files_name_the_file_and_the_fix(tmp_path, text, match):
  p = tmp_path / "config.json"
  p.write_text(text)
  with pytest.raises(ValueError, match=match) as e:
    read_json_object(p, hint="restore it")
  assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)


def test_a_directory_and_bytes_that_are_not_text(tmp_path):
  with pytest.raises(ValueError, match="is a directory, expected a JSON file"):
    read_json_object(tmp_path)
  p = tmp_path / "x.json"
  p.write_bytes(b'{"a": "\xff\xfe"}')
  with pytest.raises(ValueError, match="not valid JSON"):
    read_json_object(p)
  p.write_text('{"a": [1, 2]}')
  assert read_json_object(p) == {"a": [1, 2]}
