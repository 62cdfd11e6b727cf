"""The page at `mtcli serve`'s / in a real browser: headless Chromium (Debian's chromium and chromium-driver, which
.ci/run installs) driven by Selenium types a sentence, clicks Translate and reads the translation off the page."""

from __future__ import annotations

import shutil

import pytest
from test_serve import Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.mark.system
@pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER), reason="no browser: apt-get install chromium chromium-driver (as .ci/run does)"
)
def test_page_translates_what_a_person_types(toy_run, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the serve extra")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,700"):
        options.add_argument(flag)
    srv = Server(toy_run)
    # An explicit driver path: Selenium Manager would otherwise try to download one
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        browser.get(f"http://127.0.0.1:{srv.port}/")
        wait = WebDriverWait(browser, 30)
        wait.until(lambda b: "en → zh" in b.find_element(By.ID, "model").text)
        browser.find_element(By.ID, "source").send_keys("I love apples")
        browser.find_element(By.ID, "translate").click()
        wait.until(lambda b: b.find_element(By.ID, "output").text)
        assert browser.find_element(By.ID, "output").text == "我喜欢苹果"
        assert browser.find_element(By.ID, "error").text == ""
        assert browser.save_screenshot(str(tmp_path / "serve-page.png"))
        assert (tmp_path / "serve-page.png").stat().st_size > 1000
    finally:
        browser.quit()
        assert srv.stop() == 0
