"""`tuneforge webui` in a real headless browser (Debian's Chromium and ChromeDriver, driven by Selenium): pick the
built-in model and the project's identity data, set max_steps, start, watch the loss curve appear and the run
finish, chat with the result, stop a second run midway and find its checkpoint; a bad value is answered on the
form. Screenshots of each tab go to $TUNEFORGE_SCREENSHOTS when set (the README's come from there)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("the browser tests need Debian's chromium and chromium-driver (scripts/test.sh installs them where "
                "it can run apt-get)", allow_module_level=True)
selenium = pytest.importorskip("selenium", reason="the browser tests need selenium (the dev extra)")
pytest.importorskip("gradio", reason="the web UI needs gradio (tuneforge[webui])")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_dir):
    """`tuneforge webui` on a free port, its runs under a fresh root; stopped (by its process group) afterwards."""
    root = tmp_path_factory.mktemp("webui")
    port = _free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "TUNEFORGE_HOME": os.environ.get("TUNEFORGE_HOME", str(root / "home"))}
    log = (root / "webui.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "tuneforge.cli", "webui", "--port", str(port), "--root",
                                str(root / "saves")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None, (root / "webui.log").read_text()[-3000:]
            time.sleep(0.5)
    yield url, root
    os.killpg(process.pid, signal.SIGINT)  # the UI stops the runs it started, with a checkpoint
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
    log.close()


@pytest.fixture
def browser(server, tmp_path):
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1400,1800", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.get(server[0])
    _wait(lambda: driver.find_elements(By.ID, "start"), 60, "the page did not load")
    yield driver
    driver.quit()


def _wait(check, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds} s: {what}")


def _type(driver, elem_id, text, enter=False):
    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea, #{elem_id} input")
    box.clear()
    box.send_keys(text, Keys.ENTER if enter else Keys.TAB)


def _text(driver, elem_id):
    return driver.find_element(By.ID, elem_id).text


def _tab(driver, name):
    next(b for b in driver.find_elements(By.CSS_SELECTOR, "button[role='tab']") if b.text.strip() == name).click()


def _shot(driver, name):
    folder = os.environ.get("TUNEFORGE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"webui-{name}.png"))


def test_a_llamaboard_config_loads_into_the_form_with_its_bad_values_marked(server, browser, tmp_path):
    saved = tmp_path / "training_args.yaml"
    saved.write_text("model_name_or_path: smollm2-135m-instruct\nstage: sft\ndo_train: true\nfinetuning_type: lora\n"
                     "lora_rank: 16\ndataset: identity\ncutoff_len: long\nreport_to: none\n"
                     "include_num_input_tokens_seen: true\nnot_a_key: 1\n")
    _type(browser, "load-path", str(saved))
    browser.find_element(By.ID, "load-config").click()
    _wait(lambda: "loaded" in _text(browser, "train-message"), 30, "the config to load")
    assert "not_a_key" in _text(browser, "train-message")
    rank = browser.find_element(By.CSS_SELECTOR, "#field-lora_rank input, #field-lora_rank textarea")
    assert rank.get_attribute("value") == "16"
    cutoff = browser.find_element(By.ID, "field-cutoff_len")
    _wait(lambda: "tf-error" in cutoff.get_attribute("class"), 10, "the bad value marked")
    assert "expected an integer" in cutoff.text or "is not int" in cutoff.text
    assert "lora_rank: 16" in _text(browser, "config-yaml")


def test_train_watch_chat_and_stop_in_the_browser(server, browser):
    _, root = server
    first, second = root / "saves" / "first", root / "saves" / "second"
    # a bad value is answered on the form, naming the key, before anything starts
    _type(browser, "field-lora_rank", "0")
    _type(browser, "field-output_dir", str(first))
    browser.find_element(By.ID, "start").click()
    _wait(lambda: "lora_rank must be > 0" in _text(browser, "train-message"), 30, "the form's error")
    rank = browser.find_element(By.ID, "field-lora_rank")
    assert "tf-error" in rank.get_attribute("class") and "lora_rank must be > 0" in rank.text
    assert not first.exists()

    _type(browser, "field-lora_rank", "8")
    browser.find_element(By.ID, "preview").click()  # the rendered samples, supervised spans marked
    _wait(lambda: "⟦" in browser.find_element(By.CSS_SELECTOR, "#preview-text textarea").get_attribute("value"),
          120, "the data preview")
    _type(browser, "field-max_steps", "3")
    _wait(lambda: "max_steps: 3" in _text(browser, "config-yaml"), 30, "the YAML to follow the form")
    browser.find_element(By.ID, "start").click()
    _wait(lambda: _text(browser, "run-status").startswith("finished"), 600, "the first run to finish")
    assert "step 3/3" in _text(browser, "run-status")
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#loss-plot canvas, #loss-plot svg"), 30, "the loss curve")
    assert (first / "adapter_model.safetensors").is_file() and (first / "webui_config.yaml").is_file()
    _shot(browser, "train")

    # a second run, stopped midway: it saves a checkpoint, as the CLI's clean stop does
    _type(browser, "field-max_steps", "500")
    _type(browser, "field-output_dir", str(second))
    browser.find_element(By.ID, "start").click()
    _wait(lambda: "step 1/" in _text(browser, "run-status") or "step 2/" in _text(browser, "run-status"), 600,
          "the second run's first steps")
    browser.find_element(By.ID, "stop").click()
    _wait(lambda: _text(browser, "run-status").startswith("stopped"), 300, "the second run to stop")
    assert any(p.name.startswith("checkpoint-") for p in second.iterdir())
    browser.find_element(By.ID, "start").click()  # the CLI's rule: a folder with checkpoints is not overwritten
    _wait(lambda: "resume_from_checkpoint" in _text(browser, "train-message"), 30, "the refusal to overwrite")
    assert "tf-error" in browser.find_element(By.ID, "field-output_dir").get_attribute("class")

    _tab(browser, "Runs")
    browser.find_element(By.ID, "runs-refresh").click()
    _wait(lambda: "stopped" in _text(browser, "runs-table") and "finished" in _text(browser, "runs-table"), 30,
          "both runs listed")
    row = next(c for c in browser.find_elements(By.CSS_SELECTOR, "#runs-table [role='gridcell']") if c.text.endswith("/first"))
    row.click()
    _wait(lambda: "finished: step 3/3" in _text(browser, "runs-details"), 30, "the chosen run's details")
    _shot(browser, "runs")

    _tab(browser, "Evaluate")
    _type(browser, "eval-adapter", str(first))
    _type(browser, "eval-dataset", "identity")
    _type(browser, "eval-save-dir", str(root / "eval"))
    browser.find_element(By.ID, "eval-run").click()
    _wait(lambda: "eval_loss" in _text(browser, "eval-results"), 300, "the evaluation's results")
    assert (root / "eval" / "eval_results.json").is_file()
    _shot(browser, "evaluate")

    _tab(browser, "Export")
    _type(browser, "export-adapter", str(first))
    _type(browser, "export-dir", str(root / "merged"))
    browser.find_element(By.ID, "export-run").click()
    _wait(lambda: "MiB" in _text(browser, "export-result"), 300, "the export's path and size")
    assert str(root / "merged") in _text(browser, "export-result")
    assert (root / "merged" / "model.safetensors").is_file() and (root / "merged" / "Modelfile").is_file()
    _shot(browser, "export")

    _tab(browser, "Chat")
    _type(browser, "chat-adapter", str(first))
    browser.find_element(By.ID, "chat-load").click()
    _wait(lambda: _text(browser, "chat-loaded").startswith("loaded"), 300, "the model to load")
    assert str(first) in _text(browser, "chat-loaded")
    _type(browser, "chat-input", "Who are you?", enter=True)
    seen: list[str] = []

    def answered() -> bool:  # the streamed answer has stopped growing
        messages = browser.find_elements(By.CSS_SELECTOR, "#chatbot .message")
        seen.append(messages[-1].text.strip() if len(messages) >= 2 else "")
        return len(seen) > 4 and seen[-1] != "" and len(set(seen[-4:])) == 1

    _wait(answered, 120, "an answer")
    _shot(browser, "chat")
