"""End to end: ``GET /dashboard`` in headless Chromium, driven over the DevTools protocol.

A real gateway over two echo workers (one with a live KV event stream from a publisher in this
test, one without), a few completions with session ids, then the page opened with
``#key=<admin key>``: the DOM must show both workers and their event-stream states, the bound
sessions, and the routing decisions exactly as the requests were routed; the page must load
nothing but the gateway's own URLs, and drop the key from its address. The screenshot is checked
for content and kept (the test's tmp dir, and ``/work/dashboard.png`` where that folder exists).
A second gateway without an admin key: the page says how to enable it. Chromium missing is a
failure, not a skip (CI installs Debian's ``chromium``).
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import yaml
import zmq
from PIL import Image
from websockets.sync.client import ClientConnection, connect

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until

KEY = "dash-secret"
WIDTH, HEIGHT = 1400, 1000
# One session's turns extend its prompt (the second turn finds the first's blocks predicted).
PROMPT = " ".join(f"word{i}" for i in range(80))


def chromium_binary() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed (apt-get install chromium): the dashboard test needs it")
    return found


class DevTools:
    """One page's DevTools protocol session: commands answered in order, events kept."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]  # type: ignore[no-any-return]
            self.events.append(msg)

    def evaluate(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return out["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 15.0) -> Any:
        return wait_until(lambda: self.evaluate(expression), timeout_s=timeout_s, what=what)


@contextlib.contextmanager
def browser(procs: ProcessGroup, binary: str, profile: Path) -> Iterator[DevTools]:
    """Headless Chromium (a process of ``procs``) and a DevTools session on its page."""
    cmd = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
           f"--user-data-dir={profile}", "--remote-debugging-port=0", f"--window-size={WIDTH},{HEIGHT}", "about:blank"]
    proc = procs.start(cmd, name="chromium")
    port_file = profile / "DevToolsActivePort"
    wait_until(lambda: port_file.exists() and port_file.read_text().strip(), timeout_s=20, what="chromium's DevTools port")
    port = int(port_file.read_text().split()[0])
    pages = wait_until(lambda: [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"],
                       what="chromium's page")
    assert proc.alive(), proc.log_tail()
    with connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10) as ws:
        tools = DevTools(ws)
        tools.call("Page.enable")
        tools.call("Network.enable")
        tools.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
        yield tools


@contextlib.contextmanager
def kv_publisher(port: int) -> Iterator[None]:
    """A worker's KV event stream as vLLM's publisher sends it: a BlockStored every 100 ms."""
    stop = threading.Event()

    def run() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.bind(f"tcp://127.0.0.1:{port}")
        for seq in itertools.count():
            if stop.wait(0.1):
                break
            tokens = [seq % 30_000 + 1] * 16
            batch = [time.time(), [["BlockStored", [10_000 + seq], None, tokens, 16, None, "GPU"]]]
            sock.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
        sock.close(linger=0)
        ctx.term()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def write_config(path: Path, workers: list[dict[str, Any]], admin_key: str | None) -> Path:
    server: dict[str, Any] = {"request_timeout_s": 30}
    if admin_key:
        server["admin_key"] = admin_key
    path.write_text(yaml.safe_dump({"server": server, "workers": workers, "health": {"interval_s": 0.5}}))
    return path


def start_gateways(procs: ProcessGroup, tmp: Path, zmq_port: int) -> tuple[str, str]:
    """Two echo workers; a gateway with an admin key over both, and one without."""
    echo = {}
    for name in ("alpha", "beta"):
        port = free_port()
        echo[name] = procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", name],
                                 name=name, port=port)
    workers = [{"name": "alpha", "url": echo["alpha"].url},
               {"name": "beta", "url": echo["beta"].url, "kv_events": {"endpoint": f"tcp://127.0.0.1:{zmq_port}"}}]
    gateways = []
    for name, key in (("gateway", KEY), ("keyless", None)):
        port = free_port()
        config = write_config(tmp / f"{name}.yaml", workers, key)
        cmd = [PYTHON, "-m", "mesh.commands.serve", "--config", str(config), "--port", str(port),
               "--log-level", "warning"]
        gateways.append(procs.start(cmd, name=name, port=port))
    for proc in [*echo.values(), *gateways]:
        wait_http(proc.url + "/health", proc=proc, timeout_s=60)
    return gateways[0].url, gateways[1].url


def workers_state(client: httpx.Client) -> dict[str, dict[str, Any]]:
    resp = client.get("/workers", headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text
    return {w["name"]: w for w in resp.json()["workers"]}


FIRST_TURNS = (("s-one", 40), ("s-two", 40), ("s-one", 80), ("s-three", 20), ("s-two", 80))
# Sent while the page is open: a new session whose second turn, right behind its first, finds the
# first's blocks predicted (the index's speculative entries), a step in the prefix sparkline.
LATER_TURNS = (("s-four", 60), ("s-four", 80))


def send_turns(client: httpx.Client, turns: tuple[tuple[str, int], ...]) -> list[str]:
    """Completions of sessions whose later turns extend their prompt; the target each went to,
    in order."""
    served = []
    for session, words in turns:
        body = {"model": "echo", "prompt": " ".join(PROMPT.split()[:words]), "max_tokens": 4}
        resp = client.post("/v1/completions", json=body, headers={"x-session-id": session})
        assert resp.status_code == 200, resp.text
        served.append(resp.headers["x-mesh-worker"])
    return served


DOM = """JSON.stringify({
  refreshes: Number(document.body.dataset.refreshes || 0),
  text: document.body.innerText,
  href: location.href,
  sessions: document.getElementById("sessions-live").textContent,
  workers: [...document.querySelectorAll("#workers tr")].map(tr => [...tr.cells].map(c => c.textContent)),
  decisions: [...document.querySelectorAll("#decisions tr")].map(tr => [...tr.cells].map(c => c.textContent)),
  prefix: [...document.querySelectorAll("#prefix tr")].map(tr => [...tr.cells].map(c => c.textContent)),
  sparklines: document.querySelectorAll("#prefix svg polyline").length,
})"""


def check_screenshot(png: bytes, tmp: Path) -> Path:
    """The screenshot is a real render: the viewport's size, many colours, no colour filling it."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    colours = image.getcolors(maxcolors=WIDTH * HEIGHT)
    assert colours is not None and len(colours) > 50, f"{len(colours or [])} colours: a blank page?"
    background = max(colours)[0] / (WIDTH * HEIGHT)
    assert background < 0.9, f"one colour fills {background:.0%} of the page"
    path = tmp / "dashboard.png"
    path.write_bytes(png)
    if Path("/work").is_dir():  # a developer's machine: where the session's lead looks at it
        with contextlib.suppress(OSError):
            shutil.copyfile(path, "/work/dashboard.png")
    return path


def test_dashboard_renders_live_state_in_chromium(procs: ProcessGroup, tmp_path: Path) -> None:
    binary = chromium_binary()  # first: a machine without it fails at once
    zmq_port = free_port()
    with kv_publisher(zmq_port):
        url, keyless = start_gateways(procs, tmp_path, zmq_port)
        client = httpx.Client(base_url=url, timeout=30)
        wait_until(lambda: [w["healthy"] for w in workers_state(client).values()] == [True, True], what="workers healthy")
        wait_until(lambda: workers_state(client)["beta"]["kv_events"] == "live", what="beta's event stream live")
        served = send_turns(client, FIRST_TURNS)
        page = httpx.get(url + "/dashboard")
        assert page.status_code == 200 and "content-security-policy" in page.headers  # no key: the page holds no data
        assert client.get("/dashboard/state").status_code == 401

        with browser(procs, binary, tmp_path / "chromium") as tools:
            tools.call("Page.navigate", url=f"{url}/dashboard#key={KEY}")
            tools.wait_for("Number(document.body.dataset.refreshes || 0) >= 1", "the page's first render")
            served += send_turns(client, LATER_TURNS)  # the page refreshes itself: it shows them without a reload
            shown = len(served)
            dom = json.loads(tools.wait_for(
                f"(() => {{ const d = {DOM}, o = JSON.parse(d); return o.refreshes >= 3 && o.decisions.length >= {shown} && d; }})()",
                "the later requests shown"))
            state = workers_state(client)

            names = {row[0]: row for row in dom["workers"] if row[0]}
            assert set(names) == {"alpha", "beta"}
            assert names["alpha"][9] == "none" and names["beta"][9] == "live"  # the event-stream column
            assert [names[n][2] for n in ("alpha", "beta")] == ["healthy", "healthy"]
            assert state["beta"]["kv_events"] == "live"
            assert dom["sessions"] == "4"
            # newest first: exactly the requests sent, each on the target that served it
            assert [row[3] for row in dom["decisions"]] == served[::-1]
            assert all(row[1] == "echo" and row[2] != "–" and row[5] for row in dom["decisions"])
            # the hit rates as the gateway counts them (no request since: the counters are still)
            prefix = client.get("/dashboard/state", headers={"authorization": f"Bearer {KEY}"}).json()["prefix"]
            assert prefix["prompt"] > 0 and prefix["predicted"] > 0  # later turns found their prefix predicted
            overall = dom["prefix"][0]
            assert overall[:4] == ["all targets", *(f"{round(prefix[k]):,}" for k in ("prompt", "predicted", "reported"))]
            assert overall[4] == f"{100 * prefix['predicted'] / prefix['prompt']:.1f} %"
            assert dom["sparklines"] >= 2
            assert KEY not in dom["href"]  # the fragment left the address bar
            requested = [e["params"]["request"]["url"] for e in tools.events if e.get("method") == "Network.requestWillBeSent"]
            assert requested and all(u.startswith(url + "/dashboard") for u in requested), requested

            shot = base64.b64decode(tools.call("Page.captureScreenshot", format="png")["data"])
            check_screenshot(shot, tmp_path)

            tools.call("Page.navigate", url=f"{keyless}/dashboard#key=anything")
            text = tools.wait_for("document.getElementById('notice').innerText", "the admin-key notice")
            assert "server.admin_key" in text and "disabled" in text
        client.close()
