"""The decision report shows a few of the candidate's right and wrong holdout samples, and model output cannot
break its Markdown: checked by rendering the report with a real CommonMark + tables parser."""

import re

from markdown_it import MarkdownIt

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.tasks.evaluate import EXAMPLE_CHARS, pick_examples, score
from grpo_pipeline.tasks.promote.decide import PromotionDecision
from grpo_pipeline.tasks.promote.serving import ServingCheck
from grpo_pipeline.tasks.report import render_markdown
from grpo_pipeline.tasks.summary import Holdout, RegistryOutcome

HOSTILE = (
    "<think>a | b</think> ``` <script>alert(1)</script> **bold** [x](javascript:y)\n| 9 | 9 |\n<answer>72</answer>"
)
ROWS = [
    {"key": "q1", "prompt": "Natalia sold 48 clips in April and half as many in May. How many in all?", "answer": "72"},
    {"key": "q|2", "prompt": "What is 2 + 2? <img src=x onerror=alert(1)>", "answer": "4 | <i>4</i>"},
    {"key": "q3", "prompt": "How many legs do 3 cats have?", "answer": "12"},
    {"key": "q4", "prompt": "x" * 2000, "answer": "5"},
]
COMPLETIONS = [HOSTILE, "The answer is `5` | not 4 ~~~ <b>5</b>", "12", "7 " * 600]


def _report(examples: int) -> tuple[str, Holdout]:
    math_answer = RewardSet(names=("math_answer",))
    base = score(ROWS, ["0"] * 4, math_answer, [1] * 4)
    trained = score(ROWS, COMPLETIONS, math_answer, [len(c) for c in COMPLETIONS])
    trained = trained.model_copy(update={"examples": pick_examples(trained, "math_answer", examples)})
    holdout = Holdout.of(base, trained, None, "math_answer")
    check = ServingCheck(model_uri="models:/m/2", prompts=2, matched=2, passed=True, seconds=1.0)
    registry = RegistryOutcome(
        model="m",
        candidate_version="2",
        decided_against=None,
        moves=[],
        aliases={"champion": "2"},
        base_model="org/base",
        serving_check=check,
    )
    return render_markdown(holdout, PromotionDecision(promote=True, reasons=["gain"], stats={}), registry), holdout


def test_right_and_wrong_examples_with_prompt_reference_scores_and_completion():
    markdown, holdout = _report(examples=2)
    assert [(e.verdict, e.key) for e in holdout.examples] == [
        ("right", "q1"),
        ("right", "q3"),
        ("wrong", "q|2"),
        ("wrong", "q4"),
    ]
    assert "## Examples" in markdown
    assert "first 2 right and 2 wrong" in markdown
    assert "### 3. wrong: key q\\|2" in markdown
    long = holdout.examples[3]
    assert len(long.completion) == EXAMPLE_CHARS + 3 and long.completion.startswith("...")  # its ending
    assert ("x" * 400 + "...") in markdown and "x" * 401 not in markdown  # a prompt's beginning
    assert markdown.index("## Examples") < markdown.index("## Serving")


def test_model_output_cannot_break_the_tables_or_inject_html():
    markdown, _ = _report(examples=2)
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    page = MarkdownIt("commonmark").enable("table").render(markdown)

    # a '|' or a tag in the reference stays inside its one cell, as text (a split cell would be cut off silently)
    assert "<td>4 | &lt;i&gt;4&lt;/i&gt;</td>" in page
    # each completion comes back whole and verbatim inside one code block, markup and all
    blocks = [t.content for t in tokens if t.type == "fence"]
    assert HOSTILE + "\n" in blocks
    assert "The answer is `5` | not 4 ~~~ <b>5</b>\n" in blocks
    assert len(blocks) == 8  # a prompt and a completion for each of the four examples
    # nothing the model or the data wrote became HTML; the example headings are the four
    assert not re.search(r"<(script|img|b|i)\b", page)
    assert "&lt;script&gt;" in page and "&lt;img" in page
    assert [t.content for t in tokens if t.type == "inline" and t.content.startswith(("1. ", "2. ", "3. ", "4. "))][
        :4
    ] == ["1. right: key q1", "2. right: key q3", "3. wrong: key q\\|2", "4. wrong: key q4"]


def test_no_examples_no_section():
    markdown, holdout = _report(examples=0)
    assert holdout.examples == [] and "## Examples" not in markdown
