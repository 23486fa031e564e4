"""The demo page (`GET /`) in a real browser: headless Chromium driven through chromedriver.

The page is filled in and run as a user would; the streamed text must appear and equal the
API's greedy completion, the stats line must show the time to first token and the rate, and
a screenshot of the output box (saved under target/browser/) must show dark text on its light
background.
"""
import json
import os
import shutil
import struct
import unittest
import urllib.request
import zlib

from selenium import webdriver
from selenium.webdriver.chrome.service import Service as DriverService
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from harness import ROOT, Server

KEY = "page-key"
SHOTS = os.path.join(ROOT, "target/browser")


def png_pixels(data):
    """(width, height, rows of (r, g, b)) of an 8-bit RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        kind, cur = line[0], bytearray(line[1:])
        for i in range(stride):
            a = cur[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if kind == 1:
                cur[i] = (cur[i] + a) & 255
            elif kind == 2:
                cur[i] = (cur[i] + b) & 255
            elif kind == 3:
                cur[i] = (cur[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(cur[x * channels:x * channels + 3]) for x in range(width)])
        prev = cur
    return width, height, rows


def chromedriver():
    for name in ("chromedriver", "/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"):
        path = shutil.which(name) or (name if os.path.exists(name) else None)
        if path:
            return path
    raise RuntimeError("chromedriver not found (Debian: apt-get install chromium-driver)")


class DemoPage(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--api-key", KEY)
        options = webdriver.ChromeOptions()
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
            options.add_argument(arg)
        for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
            if os.path.exists(path):
                options.binary_location = path
        cls.browser = webdriver.Chrome(service=DriverService(chromedriver()), options=options)

    @classmethod
    def tearDownClass(cls):
        cls.browser.quit()
        cls.server.stop()

    def api_greedy(self, prompt, max_tokens):
        request = urllib.request.Request(
            self.server.url + "/v1/completions",
            data=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode(),
            headers={"content-type": "application/json", "authorization": "Bearer " + KEY},
        )
        with urllib.request.urlopen(request) as r:
            return json.load(r)["choices"][0]["text"]

    def test_the_page_streams_text_and_shows_its_rates(self):
        b = self.browser
        b.get(self.server.url + "/")
        self.assertIn("WebAssembly sandbox", b.title)
        self.assertIn("What the sandbox isolates", b.page_source)

        def fill(field, value):
            element = b.find_element(By.ID, field)
            element.clear()
            element.send_keys(value)

        fill("api_key", KEY)
        fill("prompt", "JULIET:")
        fill("max_tokens", "40")
        fill("temperature", "0")
        b.find_element(By.ID, "generate").click()
        output = b.find_element(By.ID, "output")
        WebDriverWait(b, 60).until(lambda _: output.get_attribute("data-done") == "1" or "error" in output.get_attribute("innerHTML"))
        self.assertNotIn("class=\"error\"", output.get_attribute("innerHTML"))
        shown = output.get_attribute("textContent")
        want = self.api_greedy("JULIET:", 40)
        self.assertEqual(shown, "JULIET:" + want)
        stats = b.find_element(By.ID, "stats").text
        self.assertIn("time to first token", stats)
        self.assertIn("tokens/s", stats)
        self.assertIn("40 tokens", stats)
        # look at the screenshot: the output box holds dark text on a light background
        os.makedirs(SHOTS, exist_ok=True)
        b.save_screenshot(os.path.join(SHOTS, "page.png"))
        shot = output.screenshot_as_png
        with open(os.path.join(SHOTS, "output.png"), "wb") as f:
            f.write(shot)
        width, height, rows = png_pixels(shot)
        self.assertGreater(width * height, 10000)
        pixels = [p for row in rows for p in row]
        dark = sum(1 for r, g, bl in pixels if r + g + bl < 300)
        light = sum(1 for r, g, bl in pixels if r + g + bl > 650)
        self.assertGreater(light, len(pixels) // 2, "a light background")
        self.assertGreater(dark, 200, "text drawn in it")

    def test_a_wrong_key_shows_the_error(self):
        b = self.browser
        b.get(self.server.url + "/")
        key = b.find_element(By.ID, "api_key")
        key.clear()
        key.send_keys("wrong")
        b.find_element(By.ID, "generate").click()
        output = b.find_element(By.ID, "output")
        WebDriverWait(b, 30).until(lambda _: "401" in output.text)
        self.assertIn("API key", output.text)


if __name__ == "__main__":
    unittest.main()
