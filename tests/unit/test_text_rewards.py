"""The rewards for answers that are not numbers (exact_match, label, json_fields, json_schema) on completions of
the kinds models write: right, wrong, near misses, hostile; each on its own reference; the reference checks the
data stage runs; binding a column once as an argument; and their roles."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_pipeline.configs.rewards import RewardEntry, RewardSet, default_role, resolve_roles
from grpo_pipeline.trainer.rewards import (
    REWARDS,
    RewardError,
    arguments,
    describe,
    optional_columns,
    reference_problem,
    required_columns,
    resolve_reward,
)
from grpo_pipeline.trainer.rewards.text import (
    MAX_JSON_CHARS,
    exact_match,
    find_object,
    json_fields,
    json_schema,
    label,
)

LABELS = ["positive", "negative", "neutral"]


def as_reference(answer: str) -> list[dict]:
    """The data stage offers a row's reference as the completion, in TRL's conversational format."""
    return [{"role": "assistant", "content": answer}]


# --- exact_match ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion",
    ["Paris", "paris", "PARIS.", "  Paris!  ", '"Paris"', "**Paris**", "The city.\nParis", "<answer> paris </answer>"],
)
def test_exact_match_forgives_case_punctuation_and_the_line_it_is_on(completion):
    assert exact_match([completion], answer=["Paris"]) == [1.0]


@pytest.mark.parametrize(
    "completion",
    ["Paris, France", "Pariss", "Paris\nor maybe Lyon", "The answer is Paris", "", "   \n ", "<answer></answer> Paris"],
)
def test_exact_match_forgives_nothing_else(completion):
    assert exact_match([completion], answer=["Paris"]) == [0.0]


def test_exact_match_drops_a_leading_article_on_either_side_and_keeps_signs():
    assert exact_match(
        ["the Eiffel Tower", "Eiffel Tower", "an apple"], answer=["The Eiffel Tower", "the eiffel tower", "Apple"]
    ) == [1.0, 1.0, 1.0]
    assert exact_match(["-5", "5", "C#", "C"], answer=["-5", "-5", "C#", "C#"]) == [1.0, 0.0, 1.0, 0.0]
    assert exact_match(["The"], answer=["the"]) == [1.0]  # an article alone is the answer, not dropped


def test_exact_match_reads_the_last_answer_tag_then_the_marker_then_the_last_line():
    text = "<answer>Lyon</answer> no wait <answer>Paris</answer>\nLyon"
    assert exact_match([text], answer=["Paris"]) == [1.0]
    assert exact_match([text], answer=["Paris"], answer_tag="final") == [0.0]  # not its tag: the last line, Lyon
    said = "Answer: Paris\nI hope that helps."
    assert exact_match([said, said], answer=["Paris", "I hope that helps"]) == [0.0, 1.0]  # no marker: last line
    assert exact_match([said], answer=["Paris"], marker="Answer:") == [1.0]
    assert exact_match(["Answer:\n\n  Paris \nmore"], answer=["Paris"], marker="answer:") == [1.0]
    assert exact_match(["<think>Answer: Lyon</think>\nParis"], answer=["Paris"], marker="Answer:") == [1.0]


def test_exact_match_takes_aliases_as_lists_or_json_strings():
    completions = ["NYC", "big apple", "New York", "New York City"]
    aliases = [["NYC", "The Big Apple"], '["NYC", "the Big Apple"]', json.dumps([]), None]
    assert exact_match(completions, answer=["New York City"] * 4, aliases=aliases) == [1.0, 1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match="neither a list nor a JSON array"):
        exact_match(["NYC"], answer=["New York City"], aliases=["NYC, Big Apple"])
    with pytest.raises(RewardError, match="a list of answers"):
        exact_match(["NYC"], answer=["New York City"], aliases=[[1, 2]])


def test_exact_match_unicode_forms_are_one_answer():
    assert exact_match(["ＰＡＲＩＳ", "café", "STRASSE"], answer=["Paris", "cafe\u0301", "Straße"]) == [1.0, 1.0, 1.0]


# --- label ----------------------------------------------------------------------------------------------------


def test_label_names_exactly_one_label_whole_word_any_case():
    completions = [
        "Positive",
        "The sentiment is POSITIVE.",
        "<answer>positive</answer> though partly negative",
        "positive or negative",
        "Positive.\nActually, negative.",
        "nonpositive",
        "I cannot tell",
        "negative",
    ]
    assert label(completions, answer=["positive"] * 8, labels=LABELS) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_label_prefers_the_longest_of_overlapping_labels():
    labels = ["neutral", "not neutral", "very positive", "positive"]
    completions = ["not neutral", "Not  Neutral!", "neutral", "very positive", "positive", "very positive, positive"]
    answers = ["not neutral", "not neutral", "not neutral", "very positive", "very positive", "very positive"]
    assert label(completions, answer=answers, labels=labels) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_label_labels_as_a_column_or_as_an_argument():
    per_row = [["yes", "no"], ["spam", "ham"]]
    assert label(["Yes", "spam"], answer=["yes", "spam"], labels=per_row) == [1.0, 1.0]
    assert label(["Yes", "spam"], answer=["yes", "ham"], labels=per_row) == [1.0, 0.0]
    bound = resolve_reward("label", {"labels": ["yes", "no"]})
    assert bound(["yes", "no", "yes and no"], answer=["yes", "yes", "yes"]) == [1.0, 0.0, 0.0]
    column = resolve_reward("label")
    assert column(["ham"], answer=["ham"], labels=[["spam", "ham"]]) == [1.0]
    with pytest.raises(RewardError, match="both as an argument and as a data column"):
        bound(["yes"], answer=["yes"], labels=[["yes", "no"]])
    with pytest.raises(RewardError, match="needs the task's labels"):
        column(["yes"], answer=["yes"])
    with pytest.raises(RewardError, match="each row's labels must be a list"):
        column(["yes", "no"], answer=["yes", "no"], labels=[["yes", "no"], "yes,no"])


def test_a_reference_outside_the_labels_is_never_right():
    assert label(["maybe"], answer=["maybe"], labels=["yes", "no"]) == [0.0]


# --- json_fields and json_schema --------------------------------------------------------------------------------

REF = json.dumps({"name": "Ann", "age": 34, "tags": ["a", "b"], "address": {"city": "Oslo"}}, sort_keys=True)
RIGHT = '{"name": "Ann", "age": 34, "tags": ["a", "b"], "address": {"city": "Oslo"}}'


@pytest.mark.parametrize(
    "completion",
    [
        RIGHT,
        f"Here is the record:\n```json\n{RIGHT}\n```\nLet me know if you need more.",
        f"Sure. {RIGHT} That's it.",
        RIGHT.replace("34", "34.0"),  # the same number
        RIGHT[:-1] + ', "extra": true}',  # a key the reference lacks is ignored
        f"{RIGHT}\n\nAgain: {RIGHT}",  # the same object twice is one
        f"A list [1, 2] and {RIGHT}",
    ],
)
def test_json_fields_right(completion):
    assert json_fields([completion], answer=[REF]) == [1.0]


@pytest.mark.parametrize(
    "completion",
    [
        RIGHT.replace("34", '"34"'),  # a string is not a number
        RIGHT.replace('"Ann"', '"ann"'),  # strings exactly
        RIGHT.replace('["a", "b"]', '["b", "a"]'),  # arrays in order
        RIGHT.replace('{"city": "Oslo"}', '{"city": "Oslo", "zip": "0150"}'),  # nested objects whole
        RIGHT.replace('"age": 34, ', ""),  # a field missing
        RIGHT.replace("34", "true"),
        RIGHT[:-1] + ', "name": "Bob"}',  # a key twice: ambiguous
        RIGHT.replace("34", "NaN"),
        RIGHT.replace("34", "Infinity"),
        RIGHT.replace("34", "1e999"),
        f"{RIGHT} or maybe {RIGHT.replace('34', '35')}",  # two different objects
        f"[{RIGHT}]",  # not top-level
        RIGHT[:-1],  # unterminated
        "name: Ann, age: 34",
        "",
    ],
)
def test_json_fields_wrong_or_hostile(completion):
    assert json_fields([completion], answer=[REF]) == [0.0]


def test_json_fields_named_fields_and_partial_credit():
    near = RIGHT.replace("34", "35").replace('"Oslo"', '"Bergen"')
    assert json_fields([near], answer=[REF], fields=["name", "tags"]) == [1.0]
    assert json_fields([near], answer=[REF], fields=["name", "age"]) == [0.0]
    assert json_fields([near, RIGHT, "none"], answer=[REF] * 3, partial=True) == [0.5, 1.0, 0.0]
    assert json_fields([near], answer=[REF], fields=["age", "name"], partial=True) == [0.5]


def test_json_fields_a_reference_that_is_not_an_object_scores_0():
    assert json_fields(["[1, 2]", "Ann"], answer=["[1, 2]", "Ann"]) == [0.0, 0.0]


@pytest.mark.parametrize(
    "hostile",
    [
        "[" * 100_000,
        "{" * 100_000,
        '{"a":' * 10_000,
        '{"a": [' * 5_000 + "1" + "]}" * 5_000,  # valid, too deep
        '{"' * 30_000,
        "[t" * 30_000,
        "x" * 1_000_000 + RIGHT,
        RIGHT + " " * MAX_JSON_CHARS,  # over the bound: not scanned
        '{"a": ' + "9" * 5_000 + "}",  # an integer Python refuses to read
    ],
)
def test_hostile_json_scores_0_and_returns(hostile):
    assert find_object(hostile) is None
    assert json_fields([hostile], answer=['{"a": 1}']) == [0.0]
    assert json_schema([hostile]) == [0.0]


def test_json_within_the_depth_bound_is_read():
    nested = '{"a": ' + "[" * 60 + "1" + "]" * 60 + "}"
    assert json_fields([nested], answer=[nested]) == [1.0]


def test_json_schema_is_shaping_on_the_objects_shape():
    schema = {
        "type": "object",
        "required": ["name", "age"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    }
    completions = [
        '```json\n{"name": "Bob", "age": 7}\n```',  # values need not be right: shape only
        '{"name": "Bob", "age": "7"}',
        '{"name": "Bob"}',
        '{"name": "Bob", "age": -1}',
        '{"name": "Bob", "age": 7} {"name": "Al", "age": 8}',
        "Bob, 7",
    ]
    assert json_schema(completions, schema=schema) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert resolve_reward("json_schema", {"schema": schema})(completions) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert json_schema(completions) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_a_schema_that_is_not_one_is_refused_when_resolved():
    with pytest.raises(RewardError, match="not a valid JSON Schema"):
        resolve_reward("json_schema", {"schema": {"type": "objekt"}})
    with pytest.raises(RewardError, match="must be a JSON Schema"):
        resolve_reward("json_schema", {"schema": "object"})


# --- every reward on its own reference --------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
JSON_SCALAR = (
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False) | TEXT
)
JSON_VALUE = st.recursive(
    JSON_SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=12
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(TEXT, JSON_VALUE, min_size=1, max_size=5))
def test_json_fields_scores_its_reference_1(obj):
    reference = json.dumps(obj, sort_keys=True, ensure_ascii=False)  # as the data stage serializes it
    assert reference_problem("json_fields", None, reference, {}) is None
    assert json_fields([as_reference(reference)], answer=[reference]) == [1.0]
    assert json_fields([as_reference(reference)], answer=[reference], partial=True) == [1.0]
    assert json_schema([as_reference(reference)]) == [1.0]


@settings(max_examples=200, deadline=None)
@given(TEXT | st.sampled_from(["Paris\u2028France", "...", "the", "“Paris”", " a b ", "x\x0by"]))
def test_exact_match_scores_its_reference_1_or_says_why(answer):
    problem = reference_problem("exact_match", None, answer, {})
    score = exact_match([as_reference(answer)], answer=[answer])
    assert problem or score == [1.0]  # a reference it cannot judge is quarantined, whatever it scores


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        TEXT.filter(lambda s: s.strip()), min_size=2, max_size=5, unique_by=lambda s: " ".join(s.casefold().split())
    ),
    st.data(),
)
def test_label_scores_its_reference_1_or_says_why(labels, data):
    answer = data.draw(st.sampled_from(labels))
    problem = reference_problem("label", {"labels": labels}, answer, {})
    assert problem is None or "several lines" in problem, problem
    if problem is None:
        assert label([as_reference(answer)], answer=[answer], labels=labels) == [1.0]


def test_the_shipped_references_each_score_1():
    assert exact_match([as_reference("The Eiffel Tower.")], answer=["The Eiffel Tower."]) == [1.0]
    assert label([as_reference("not neutral")], answer=["not neutral"], labels=["neutral", "not neutral"]) == [1.0]
    assert json_fields([as_reference(REF)], answer=[REF]) == [1.0]


# --- reference checks -------------------------------------------------------------------------------------------


def test_reference_problem_says_why_a_row_cannot_be_judged():
    assert reference_problem("label", {"labels": ["positive", "negative"]}, "maybe", {}) == (
        "the answer 'maybe' is not among the labels (negative, positive): add it to labels or fix the row"
    )
    assert reference_problem("label", None, "yes", {"labels": ["yes", "no"]}) is None
    assert "labels are a string" in reference_problem("label", None, "yes", {"labels": "yes, no"})
    assert "no labels for this row" in reference_problem("label", None, "yes", {})
    assert "both as an argument" in reference_problem("label", {"labels": ["yes", "no"]}, "yes", {"labels": ["yes"]})
    assert reference_problem("json_fields", None, "[1, 2]", {}) == "the answer is not a JSON object (it is a list)"
    assert reference_problem("json_fields", None, "Ann, 34", {}).startswith("the answer is not JSON")
    assert "key twice" in reference_problem("json_fields", None, '{"a": 1, "a": 2}', {})
    assert reference_problem("json_fields", {"fields": ["age"]}, '{"name": "Ann"}', {}) == (
        "the answer lacks the field 'age' that json_fields' fields names"
    )
    assert "aliases" in reference_problem("exact_match", None, "Paris", {"aliases": 3})
    assert reference_problem("exact_match", None, "Paris", {"aliases": '["Lutetia"]'}) is None
    assert "several lines" in reference_problem("exact_match", None, "Paris\nFrance", {})
    assert reference_problem("json_schema", None, "anything", {}) is None  # no reference to check
    assert reference_problem("math_answer", None, "x", {}) is None


# --- the registry: columns, arguments, roles --------------------------------------------------------------------


def test_columns_and_arguments():
    assert (required_columns(REWARDS["label"]), optional_columns(REWARDS["label"])) == (["answer"], ["labels"])
    assert optional_columns(REWARDS["exact_match"]) == ["aliases"]
    assert required_columns(REWARDS["json_schema"]) == [] and optional_columns(REWARDS["json_schema"]) == []
    assert "labels" in arguments(REWARDS["label"])
    assert describe("label")["optional_columns"] == ["labels"]
    assert optional_columns(REWARDS["overlong_penalty"]) == []  # completion_ids, completion_lengths: the runner's


def test_resolve_reward_binds_a_column_as_an_argument_and_refuses_unknown_ones():
    with pytest.raises(RewardError, match="takes no argument 'label_set'; its arguments: labels=None"):
        resolve_reward("label", {"label_set": ["a", "b"]})
    with pytest.raises(RewardError, match="two or more distinct"):
        resolve_reward("label", {"labels": ["yes"]})
    with pytest.raises(RewardError, match="aliases is a column"):
        resolve_reward("exact_match", {"aliases": ["NYC"]})
    with pytest.raises(RewardError, match="fields must be a non-empty list"):
        resolve_reward("json_fields", {"fields": "age"})
    with pytest.raises(RewardError, match="partial must be true or false"):
        resolve_reward("json_fields", {"partial": "yes"})
    assert resolve_reward("exact_match", {"marker": "Answer:"})(["Answer: Oslo"], answer=["oslo"]) == [1.0]


def test_roles():
    assert [default_role(n) for n in ("exact_match", "label", "json_fields", "json_schema")] == [
        "skill",
        "skill",
        "skill",
        "shaping",
    ]
    assert default_role("json_fields", {"partial": True}) == "shaping"
    assert default_role("json_fields", {"partial": False}) == "skill"
    entries = (RewardEntry(name="exact_match"), RewardEntry(name="json_fields", args={"partial": True}))
    assert [e.role for e in resolve_roles(entries)] == ["skill", "shaping"]
    rs = RewardSet(entries=[{"name": "json_fields", "args": {"partial": True}}, "json_schema", "label"])
    assert (rs.skill, rs.shaping) == ("label", ("json_fields", "json_schema"))
    with pytest.raises(ValueError, match="no skill reward"):
        RewardSet(entries=[{"name": "json_fields", "args": {"partial": True}}, "json_schema"])
