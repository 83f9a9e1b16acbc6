from grpo_pipeline.tasks.evaluate import read_jsonl


def test_a_line_separator_inside_a_string_does_not_split_the_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"q": "a\u2028b"}\n\n{"q": "c"}\n', encoding="utf-8")
    assert [r["q"] for r in read_jsonl(path)] == ["a\u2028b", "c"]
