"""The page at ``/`` in a real headless Chromium (Selenium + chromedriver) against the real engine on CPU.

Needs the Debian packages ``chromium`` and ``chromium-driver`` and the pip package ``selenium``.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from PIL import Image

from dualtrack import imaging
from dualtrack.serve import create_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 120.0

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs headless Chromium: apt-get install -y chromium chromium-driver",
)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: pip install selenium")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def base_url(tiny_bundle: Path) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(tiny_bundle, max_batch_delay_ms=1), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + WAIT_S
    while not (server.started and httpx.get(f"{base}/readyz").status_code == 200):
        assert time.monotonic() < deadline, "server did not get ready"
        time.sleep(0.05)
    yield base
    server.should_exit = True
    thread.join(WAIT_S)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=900,900"):
        options.add_argument(arg)
    # An explicit driver path: Selenium must not try to download a driver or a browser.
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def _upload(browser, path: Path) -> str:
    """Choose ``path`` in the page's file input; return the page's final state (done or error)."""
    browser.execute_script("document.body.dataset.state = 'idle'")
    browser.find_element(By.ID, "file").send_keys(str(path))
    WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") in ("done", "error")
    )
    return browser.find_element(By.TAG_NAME, "body").get_attribute("data-state")


def test_upload_png_shows_mask_overlay(browser, base_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng()
    pixels = rng.integers(0, 256, (48, 72, 3), dtype=np.uint8)
    path = tmp_path / "photo.png"
    Image.fromarray(pixels).save(path)
    browser.get(f"{base_url}/")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "status").text.startswith("ready"))

    assert _upload(browser, path) == "done", browser.find_element(By.ID, "error").text
    assert browser.find_element(By.ID, "view").is_displayed()
    assert not browser.find_element(By.ID, "error").is_displayed()
    assert "class " in browser.find_element(By.ID, "legend").text

    # The canvas holds the photo blended with the palette colour of each pixel's class.
    data_url = browser.execute_script("return document.getElementById('view').toDataURL('image/png')")
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).convert("RGB"))
    assert shown.shape == pixels.shape
    mask = imaging.decode_mask_png(httpx.post(f"{base_url}/v1/segment", content=path.read_bytes()).content)
    palette = np.array(browser.execute_script("return PALETTE"), dtype=np.float64)
    alpha = browser.execute_script("return ALPHA")
    expected = pixels * (1 - alpha) + palette[mask % len(palette)] * alpha
    assert np.abs(shown.astype(np.float64) - expected).max() <= 1.0


def test_upload_text_file_shows_server_error(browser, base_url: str, tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("definitely not an image\n")
    browser.get(f"{base_url}/")
    assert _upload(browser, path) == "error"
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed()
    assert "not a PNG or JPEG image" in error.text
    assert not browser.find_element(By.ID, "result").is_displayed()
