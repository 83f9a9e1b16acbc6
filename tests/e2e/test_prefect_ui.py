"""A person's run from the Prefect UI, in a real browser: Debian's Chromium, driven by Playwright (no browser is
downloaded), against the local stack (`grpo-pipeline stack up`: PostgreSQL, S3, MLflow and Prefect servers) and a
process worker, with the tiny random model.

As a person does it: log in with the auth string `grpo-pipeline stack env` prints, open the `manual` deployment,
*Run → Custom run*, fill the form (another allowed recipe as `config_path`, `train.grpo.max_steps=2` as an
override), submit, follow the run to *Completed* and open its `grpo-decision` report. A second form run asks for a
recipe the deployment does not allow and a field its trigger policy does not let a form set: the run fails before
any work and its log tells the person, once and plainly, which field and how to allow it (no traceback).

The screenshots of docs/operations.md ("Running from the Prefect UI") are taken here, at each step.
`make test-slow` (Chromium installed by the Makefile); a few minutes on 2 cores.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urljoin

import pytest
import yaml

from grpo_pipeline.flows.trigger import FINISHED_REFUSED
from tests.conftest import TINY_TRAIN

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no Chromium on PATH: install Debian's package (`apt-get install -y chromium`; `make test-slow` does)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[dev]'")

RUN_DEADLINE_S = 1200  # a tiny run takes minutes on a busy 2-core machine; the deadline only bounds a hang
STEP_MS = 60_000  # one page step (a page load, a click's effect), generous for a loaded machine
REFUSED_BY_POLICY = "train.grpo.beta"  # allowed by no default policy, and no risk either: a form may be let


@pytest.fixture(scope="module")
def stack(local_stack, mlflow_server_uri):
    local_stack.up()
    return local_stack


@pytest.fixture(scope="module")
def env(stack, tmp_path_factory) -> dict[str, str]:
    """What a user's shell has after `eval "$(grpo-pipeline stack env)"`."""
    return {
        **os.environ,
        **stack.env(),
        "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home")),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


@pytest.fixture(scope="module")
def recipes(tmp_path_factory, tiny_model) -> dict[str, Path]:
    """The deployment's own config, and a second recipe its policy lets a form pick (fewer training rows)."""
    work = tmp_path_factory.mktemp("ui")
    own = work / "ui.yaml"
    short = work / "ui-short.yaml"
    cfg = {
        "data_dir": str(work / "data"),
        "data": {"demo": {"max_operand": 9, "n_train": 32, "n_val": 4, "n_holdout": 6}},
        "model": {"base": str(tiny_model)},
        "train": {"checkpoint_every": 1, "grpo": {"max_steps": 4}},
        "evaluate": {"max_new_tokens": 6, "batch_size": 4},
        "tracking": {"experiment": "ui", "registered_model": "ui-adapter"},
        "check": {"enabled": False},  # a random model's task is too_hard; this test is about the UI
        "deploy": {"trigger": {"recipes": [str(short)]}},
    }
    own.write_text(yaml.safe_dump(cfg))
    short.write_text(yaml.safe_dump({**cfg, "data": {"demo": {**cfg["data"]["demo"], "n_train": 24}}}))
    return {"own": own, "short": short}


@pytest.fixture(scope="module")
def deployed(env, recipes):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_pipeline.cli",
            "deploy",
            "--config",
            str(recipes["own"]),
            *sum((["--set", o] for o in TINY_TRAIN), []),
        ],
        env=env,
        cwd=ROOT,  # the worker runs the flows here (the deployments' pull step)
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def worker(deployed, env, tmp_path_factory):
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "grpo-process"],
            env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    yield log
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, stack, worker, env):
    """A fresh browser context (no stored login) on the Prefect UI, logged in as a person does."""
    context = browser.new_context(viewport={"width": 1280, "height": 860}, color_scheme="light")
    context.set_default_timeout(STEP_MS)
    page = context.new_page()
    log_in(page, stack.service("prefect").url.removesuffix("/api"), env["PREFECT_API_AUTH_STRING"])
    yield page
    context.close()


# --- what a person does, step by step ---------------------------------------------------------------------------


def log_in(page, ui: str, auth_string: str) -> None:
    """The login page asks for "admin:pass"-shaped text: the whole auth string of `stack env`."""
    page.goto(ui)
    field = page.get_by_placeholder("admin:pass")
    field.wait_for()
    shot(page, "login")  # before anything is typed: the field shows what it holds
    field.fill(auth_string)
    page.get_by_role("button", name="Login").click()
    page.get_by_role("link", name="Deployments").first.wait_for()


def open_custom_run(page) -> None:
    """Deployments → manual → Run → Custom run: the typed form of the flow's parameters."""
    page.get_by_role("link", name="Deployments").first.click()
    page.get_by_role("link", name="manual", exact=True).first.click()
    page.get_by_role("button", name="Run").first.click()
    page.get_by_text("Custom run", exact=True).first.click()
    page.get_by_text("config_path (Optional)", exact=True).wait_for()


def field(page, label: str):
    """The form group of one parameter, found by its label as the person reads it."""
    return page.locator("div.group", has=page.get_by_text(f"{label} (Optional)", exact=True)).last


def fill_form(page, config_path: str, override: str) -> None:
    """The config file the run uses, and one more override appended to the deployment's own."""
    config = field(page, "config_path").locator("textarea")
    config.fill(config_path)
    overrides = field(page, "overrides")
    overrides.get_by_role("button", name="Add item").click()
    overrides.locator("textarea").last.fill(override)


def submit(page) -> None:
    """Submit; the toast's *View run* link leads to the new run's page (followed by its address: the toast is gone
    within seconds, and a click on it can land on the page beneath as it slides away)."""
    page.get_by_role("button", name="Submit").click()
    view = page.get_by_role("link", name="View run").first
    run_page = view.get_attribute("href")
    assert run_page and re.fullmatch(r".*/runs/flow-run/[0-9a-f-]+", run_page), run_page
    page.goto(urljoin(page.url, run_page))


FINAL = re.compile(r"^(Completed|Failed|Crashed|Cancelled)$")


def wait_for_final_state(page) -> str:
    """The run page's state badge once the run is final; the page is reloaded now and then, as a person would,
    in case it does not refresh itself."""
    deadline = time.monotonic() + RUN_DEADLINE_S
    badge = page.get_by_text(FINAL).first
    while True:
        try:
            badge.wait_for(timeout=30_000)
            return badge.inner_text().strip()
        except sync_api.TimeoutError:
            assert time.monotonic() < deadline, f"the run at {page.url} reached no final state"
            page.reload(wait_until="domcontentloaded")


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def wait_in_tab(page, tab: str, text: str) -> None:
    """`text` shown in the run page's `tab`; the page is reloaded now and then (the engine sends a run's last log
    lines after its final state)."""
    deadline = time.monotonic() + 300
    while True:
        open_tab(page, tab)
        try:
            page.get_by_text(text).first.wait_for(timeout=30_000)
            return
        except sync_api.TimeoutError:
            assert time.monotonic() < deadline, f"{text!r} never appeared in {tab} of {page.url}"
            page.reload(wait_until="domcontentloaded")


def shot(page, name: str, full_page: bool = False) -> Path:
    """A screenshot for docs/operations.md, kept small: a 64-colour PNG (the UI is flat colours and text)."""
    from PIL import Image

    IMAGES.mkdir(parents=True, exist_ok=True)
    path = IMAGES / f"prefect-ui-{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=64).save(path, optimize=True)
    return path


# --- the tests ------------------------------------------------------------------------------------------------


def test_a_form_run_completes_and_shows_its_report(page, recipes, env, worker):
    open_custom_run(page)
    fill_form(page, str(recipes["short"]), "train.grpo.max_steps=2")
    shot(page, "form", full_page=True)
    submit(page)
    state = wait_for_final_state(page)
    shot(page, "run")
    assert state == "Completed", f"{page.locator('main').inner_text()[-3000:]}\n{worker.read_text()[-3000:]}"

    # what the form sent is what the run used: the server's record of it
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    run_id = page.url.rstrip("/").rpartition("/")[2].partition("?")[0]
    settings = {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}
    with temporary_settings(settings), get_client(sync_client=True) as client:
        parameters = client.read_flow_run(run_id).parameters
    assert parameters["config_path"] == str(recipes["short"])
    assert parameters["overrides"][-1] == "train.grpo.max_steps=2", parameters

    open_tab(page, "Artifacts")
    page.get_by_text("grpo-decision", exact=True).click()
    report = page.get_by_text(re.compile(r"Skill \(correct_answer\)")).first
    report.wait_for()
    shot(page, "report", full_page=True)
    text = page.locator("main").inner_text()
    assert re.search(r"Skill \(correct_answer\): \d\.\d+ (->|→) \d\.\d+", text), text[:3000]


def test_a_refused_field_shows_its_reason_and_the_fix_not_a_traceback(page):
    open_custom_run(page)
    fill_form(page, "/etc/hosts", f"{REFUSED_BY_POLICY}=0.1")
    submit(page)
    assert wait_for_final_state(page) == "Failed"
    wait_in_tab(page, "Logs", FINISHED_REFUSED)  # the engine's last line, after the refusal
    shot(page, "refused", full_page=True)
    log = page.locator("main").inner_text()
    # the recipe and the field, each with why and how to allow it
    assert "config_path: this deployment runs" in log and "add it to deploy.trigger.recipes" in log, log
    assert f"{REFUSED_BY_POLICY}: is not among the fields this deployment lets a trigger set" in log, log
    assert "add it to deploy.trigger.allow" in log, log
    # once, plainly: no traceback, no repeat as a Python repr with literal \n
    assert log.count("may not set (nothing was run)") == 1, log
    assert "Traceback" not in log and "\\n" not in log and "ConfigError" not in log, log
