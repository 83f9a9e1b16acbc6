"""The benchmark suite's table and analysis: pure functions over saved results, no model."""

import pytest

from bench.__main__ import available, main, rows
from bench.table import END, START, Row, render, replace_block, update_page, verdict


def test_every_benchmark_gives_rows_before_anything_ran():
    table = rows(available(), load=lambda name: None)
    assert table, "the suite has benchmarks"
    assert all(r.ratio is None for r in table)
    assert {r.verdict for r in table} <= {"not run yet", "not measured"} | {r.note for r in table if r.note}
    assert any("lora_vs_full" in r.benchmark for r in table)


def test_the_table_block_is_replaced_and_the_rest_kept(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# title\nintro\n{START}\nstale table\n{END}\n## next\n")
    update_page(page, [Row("x", "base: 1 s", "cand: 2 s", 2.0, "<= 1.05")])
    text = page.read_text()
    assert text.startswith("# title\nintro\n") and text.endswith(f"{END}\n## next\n")
    assert "stale table" not in text and "| x | base: 1 s | cand: 2 s | **2.000** | ≤ 1.05 | misses |" in text
    update_page(page, [Row("x", "base: 1 s", "cand: 2 s", 2.0, "<= 1.05")])
    assert page.read_text() == text  # regenerating from the same results changes nothing
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError, match="bare.md"):
        update_page(bare, [])
    assert bare.read_text() == "no markers\n"


def test_the_table_lives_in_docs_benchmarks_and_is_up_to_date():
    from bench.__main__ import PAGE, ROOT

    assert PAGE == ROOT / "docs" / "benchmarks.md"
    text = PAGE.read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    assert START not in (ROOT / "README.md").read_text(), "the README links the table, it does not hold it"
    saved = text[text.index(START) + len(START) + 1 : text.index(END) - 1]
    assert saved == render(rows(available())), "docs/benchmarks.md is stale: run `python -m bench table`"


def test_missing_markers_and_bad_goals_are_named():
    with pytest.raises(ValueError, match="bench:start"):
        replace_block("no table here", "x")
    with pytest.raises(ValueError, match="expected '<op> <number>'"):
        verdict(1.0, "about 1")


def test_suite_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        main(["no_such_benchmark"])
    assert "unknown benchmark" in capsys.readouterr().err


def test_rendered_table_has_one_line_per_row():
    table = render([Row("a", "b", "c", 1.0, ">= 3"), Row("d", "e", "f", None, "", note="not run yet")])
    assert len(table.splitlines()) == 4 and "| not run yet |" in table


def test_serving_rows_read_the_saturation_throughput_swap_and_merged_ratios():
    from bench.serving import table_rows as serving_rows

    def side(rps, p95, tok):
        return {"requests_per_s": rps, "p95_s": p95, "tokens_per_s": tok}

    result = {
        "model": "m",
        "tokens": 16,
        "overhead": {
            "1": {"engine": [side(1.0, 1.0, 1)], "router": [side(0.5, 2.0, 1)]},  # not the saturation: ignored
            "16": {
                "engine": [side(10.0, 2.0, 1), side(12.0, 2.0, 1)],
                "router": [side(9.8, 2.1, 1), side(11.0, 2.0, 1)],
            },
        },
        "hot_swap": {"plain_request_s": 0.5, "swaps": [{"first_answer_s": 1.0}, {"first_answer_s": 2.0}]},
        "stacked_vs_merged": {"16": {"stacked": [side(0, 0, 50.0)], "merged": [side(0, 0, 150.0)]}},
    }
    overhead, p95, swap, merged = serving_rows(lambda name: result if name == "serving" else None)
    assert "concurrency 16" in overhead.benchmark and overhead.goal == "<= 1.05"
    assert overhead.spread == pytest.approx((10 / 9.8, 12 / 11)) and overhead.verdict == "within noise"
    assert p95.ratio == pytest.approx((2.1 / 2.0 + 1.0) / 2)
    assert swap.ratio == pytest.approx(1.5 / 0.5) and swap.verdict == "reported"
    assert merged.ratio == pytest.approx(3.0) and "merged model: 150.0 tok/s" in merged.candidate


def _profile_run(step_s, phases):
    return {
        "threads": 2,
        "summary": {
            "step_s": {"median": step_s, "min": step_s, "max": step_s, "n": 1},
            "phases": {
                name: {"group": group, "median_s": s, "share": s / step_s, "calls": 1}
                for name, (group, s) in phases.items()
            },
            "compute_share": 0.5,
        },
        "profiled_step": {"wall_s": step_s, "phases": {"decode": {"s": 4.0, "op_s": 2.0, "ops": 300}}, "calls": {}},
        "checkpoint": {"s": 1.0, "every": 10, "amortized_s": 0.1},
        "logp_passes": {"with_grad": ["policy"], "no_grad": []},
    }


def test_step_profile_table_groups_phases_and_reads_each_precision():
    from bench.step_profile import GEN, OTHER, markdown
    from bench.step_profile import table_rows as profile_rows

    run = _profile_run(10.0, {"decode": (GEN, 4.0), "prefill": (GEN, 1.0), "callback: X": (OTHER, 0.5)})
    result = {"runs": {"fp32": run, "bf16": _profile_run(5.0, {"decode": (GEN, 2.0)})}}
    text = markdown(result)
    assert "| **generation** | **5.000** | **50.0 %** | | |" in text
    assert "| decode | 4.000 | 40.0 % | 1 | 50 % (300 ops) |" in text  # half the profiled decode was torch ops
    assert text.index("decode |") < text.index("prefill |")  # largest first within a group
    assert "**bf16**" in text and "every 10 steps: 0.100 s per step" in text
    rows = profile_rows(lambda name: result if name == "step_profile" else None)
    assert [r.ratio for r in rows] == [50.0, 50.0] and "fp32" in rows[0].benchmark and "bf16" in rows[1].benchmark
    assert "generation 5.00 s" in rows[0].baseline


def test_step_profile_refuses_bad_input_before_loading_a_model(capsys):
    from bench.step_profile import main
    from grpo_pipeline.trainer.precision import cpu_has_native_bf16

    with pytest.raises(SystemExit) as exc:
        main(["--set", "train.grpo.no_such_field=1"])
    assert exc.value.code == 2 and "no_such_field" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--steps", "0"])
    assert exc.value.code == 2
    if not cpu_has_native_bf16():
        with pytest.raises(SystemExit) as exc:
            main(["--precision", "bf16"])
        assert exc.value.code == 2 and "avx512_bf16" in capsys.readouterr().err


def test_a_results_machine_stamp_names_the_cpu_model_and_falls_back_where_cpuinfo_has_none(tmp_path):
    import platform

    from bench.harness import cpu_model, stamp

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n")
    assert cpu_model(info) == "AMD EPYC 9R14 96-Core Processor"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # arm64 Linux: no model name line
    fallback = platform.processor() or platform.machine()
    assert cpu_model(info) == cpu_model(tmp_path / "absent") == fallback != ""
    machine = stamp()["machine"]
    assert isinstance(machine["native_bf16"], bool) and machine["cpu"] and machine["cpus"] >= 1
