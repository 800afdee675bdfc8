#!/usr/bin/env python3
"""The web page (web/, built by make web) in headless Chromium, against the CLI.

Chromium is driven over its DevTools protocol (a websocket, python3-websocket): the test loads the page, sets
its inputs as a person would (value + input event), waits for the debounced update, reads what the page shows
(the peak cards, the breakdown rows, the verdict, fit's answer, the error line, the tables printed "as the CLI
prints it") and checks each against `trainmem estimate|fit ... --format json` (and the CLI's tables) for the
same scenario. Screenshots go to --out (screenshot.png: the LoRA + GPU scenario).

Exit 77 (ctest: skipped) only where Chromium or emscripten is not installed (bash scripts/setup.sh installs
both); a page that should have been built and is not is a failure.
"""
import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SKIP = 77
WAIT_S = 180  # one update: an estimate and a fit in WebAssembly, on a busy 2-core machine

# The pasted config.json: OPT-125m's own (data/models/opt-125m.json), as a user would paste a downloaded one.
LORA_GPU = {"model": "tinyllama-1.1b", "lora": "r=16,alpha=32,targets=q_proj,v_proj", "gpu": "rtx-4090",
            "precision": "bf16", "batch": "2", "seq": "512"}


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


class Browser:
    """Headless Chromium with one page, over the DevTools protocol."""

    def __init__(self, profile):
        import websocket  # python3-websocket

        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={profile}", "--window-size=1280,1400", "--hide-scrollbars", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        deadline = time.time() + 60
        while port is None and time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            if "DevTools listening on ws://" in line:
                port = line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
        if port is None:
            raise SystemExit("FAIL: chromium did not start its DevTools endpoint")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=WAIT_S,
                                              suppress_origin=True)
        self.next_id = 0
        self.console = []
        self.send("Runtime.enable")
        self.send("Page.enable")

    def send(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in msg["params"]["args"]))
            if msg.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:2000])
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise SystemExit(f"FAIL: DevTools {method}: {msg['error']}")
                return msg["result"]

    def js(self, expression):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise SystemExit(f"FAIL: page script: {json.dumps(r['exceptionDetails'])[:2000]}")
        return r["result"].get("value")

    def wait(self, condition, what):
        deadline = time.time() + WAIT_S
        while time.time() < deadline:
            if self.js(condition):
                return
            time.sleep(0.2)
        raise SystemExit(f"FAIL: timed out waiting for {what}; console: {self.console[-5:]}")

    def screenshot(self, path):
        data = self.send("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def load(b, url):
    b.send("Page.navigate", url=url)
    b.wait("document.readyState === 'complete' && document.body && document.body.dataset.state !== 'loading'",
           f"the page at {url} to load the library")


# Sets the page's inputs as a person would: the form's own fields, then one input event each.
SET_FIELDS = """
(values => {
  for (const el of document.querySelectorAll('[data-field]')) el.value = '';
  for (const [name, value] of Object.entries(values)) {
    const el = name === 'config' ? document.getElementById('config') : document.querySelector(`[data-field="${name}"]`);
    if (!el) throw new Error('no input for ' + name);
    el.value = value;
    if (el.value !== value) throw new Error(`${name}: the page has no choice ${value}`);
    el.dispatchEvent(new Event('input', {bubbles: true}));
  }
  return document.body.dataset.requested;
})(%s)
"""

# What the page shows, as data.
READ = """
(() => {
  const bytes = id => { const e = document.querySelector(`#${id} .value`); return e ? e.dataset.bytes : null; };
  const v = document.getElementById('verdict'), fit = document.getElementById('fit'), err = document.getElementById('error');
  return {
    state: document.body.dataset.state,
    peak_allocated: bytes('peak-allocated'), peak_reserved: bytes('peak-reserved'), device_total: bytes('device-total'),
    components: [...document.querySelectorAll('#breakdown tbody tr')].map(tr => [tr.dataset.component, tr.children[1].dataset.bytes]),
    verdict: v.hidden ? null : {fits: v.dataset.fits, headroom: v.dataset.headroom, text: v.textContent},
    fit_largest: fit.hidden ? null : fit.dataset.largest,
    error: err.hidden ? null : err.textContent,
    estimate_table: document.getElementById('estimate-table').textContent,
    fit_table: document.getElementById('fit-table').textContent,
    timeline_svg: !!document.querySelector('#timeline-svg svg'), breakdown_svg: !!document.querySelector('#breakdown-svg svg'),
    cli: document.getElementById('cli-command').textContent,
    answer: window.trainmemPage.estimate, fit_answer: window.trainmemPage.fit,
  };
})()
"""


def set_and_read(b, values):
    b.js(SET_FIELDS % json.dumps(values))
    b.wait("document.body.dataset.done === document.body.dataset.requested && "
           "['ready', 'error'].includes(document.body.dataset.state)", f"the page to update for {values}")
    return b.js(READ)


def cli(trainmem, sub, fields, cwd, fmt="json"):
    args = [trainmem, sub]
    for k, v in fields.items():
        args += ["--" + k.replace("_", "-"), v]
    args += ["--format", fmt]
    p = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise SystemExit(f"FAIL: {' '.join(args)}: exit {p.returncode}: {p.stderr}")
    return json.loads(p.stdout) if fmt == "json" else p.stdout


class Check:
    def __init__(self):
        self.passed = self.failed = 0

    def eq(self, what, page, want):
        if str(page) == str(want):
            self.passed += 1
        else:
            self.failed += 1
            a, b = str(page), str(want)
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"  MISMATCH {what} at character {at}: page {a[max(0, at - 80):at + 120]!r}, "
                  f"CLI {b[max(0, at - 80):at + 120]!r} (lengths {len(a)}, {len(b)})")


# The WebAssembly build's C++ library is libc++, whose std::vector destroys its elements last to first, where
# libstdc++'s (the CLI's) goes first to last: when a vector of the simulator's tensors goes out of scope (the
# autocast cache at the end of a forward, a foreach optimizer's temporaries) the same tensors are freed in the
# other order. Each such run of frees ends in the same state (live bytes, allocated, reserved), so no figure
# differs; the timeline compares each maximal run of frees as a set, with the state after it, and every other
# event exactly. (The timeline picture's columns show the moment with the most live bytes, which within such a
# run can differ: its paths are left out of the comparison, the rest of the picture is compared.)
STATE = ("live_bytes", "live_total_bytes", "allocated_bytes", "reserved_bytes", "max_allocated_bytes",
         "max_reserved_bytes", "peak_live", "peak_allocated", "peak_reserved", "oom")


def numbers(x):
    """JSON as JavaScript reads it: a number is a double (0.0 and 0 are one number), so the CLI's JSON is read
    the same way before the two are compared."""
    if isinstance(x, dict):
        return {k: numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [numbers(v) for v in x]
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return int(x)
    return x


def free_runs(timeline):
    out, run = [], []

    def close():
        if run:
            out.append({"frees": sorted(json.dumps({k: v for k, v in r.items() if k not in STATE + ("first_event", "last_event", "max_live_bytes")}, sort_keys=True) for r in run),
                        "after": {k: run[-1].get(k) for k in STATE if k not in ("peak_live", "peak_allocated", "peak_reserved")}})
            run.clear()

    for r in timeline["rows"]:
        if r.get("kind") == "free":
            run.append(r)
        else:
            close()
            out.append(r)
    close()
    return {**{k: v for k, v in timeline.items() if k != "rows"}, "rows": out}


def compare(c, name, page, trainmem, fields, cwd, b):
    est = cli(trainmem, "estimate", fields, cwd)
    m = est["memory"]
    print(f"{name}: page peak allocated {page['peak_allocated']}, CLI {m['peak_allocated_bytes']}")
    c.eq(f"{name} state", page["state"], "ready")
    c.eq(f"{name} peak allocated", page["peak_allocated"], m["peak_allocated_bytes"])
    c.eq(f"{name} peak reserved", page["peak_reserved"], m["peak_reserved_bytes"])
    c.eq(f"{name} device total", page["device_total"], m.get("device_total_bytes"))
    c.eq(f"{name} components", page["components"], [[x["name"], str(x["bytes"])] for x in est["peak_components"]])
    c.eq(f"{name} estimate table", page["estimate_table"], cli(trainmem, "estimate", fields, cwd, "table"))
    c.eq(f"{name} pictures drawn", (page["timeline_svg"], page["breakdown_svg"]), (True, True))
    # behind what is shown: the library's whole answer, and the pictures' text, as the CLI's
    c.eq(f"{name} estimate JSON", json.dumps(numbers(page["answer"]["estimate"]), sort_keys=True),
         json.dumps(numbers(est), sort_keys=True))
    for sub, key in (("timeline", "timeline"), ("estimate", "breakdown")):
        svg = os.path.join(cwd, f"{key}.svg")
        cli(trainmem, sub, {**fields, "plot": svg}, cwd, "table")
        with open(svg) as f:
            want = f.read()
        got = page["answer"]["svg"][key]
        if key == "timeline":  # the curves' and areas' paths: see free_runs()
            got, want = (re.sub(r' d="[^"]*"', "", x) for x in (got, want))
        c.eq(f"{name} {key} picture", got, want)
    # every event of the step, as `trainmem timeline --by event` lists them
    files = {"config.json": open(os.path.join(cwd, "config.json")).read()} if fields.get("model") == "config.json" else {}
    tl = b.js("JSON.stringify(trainmemPage.call('trainmem_estimate_json', %s).timeline)"
              % json.dumps({"fields": fields, "files": files, "timeline": {"by": "event"}}))
    want = cli(trainmem, "timeline", {**fields, "by": "event"}, cwd)
    got = json.loads(tl)
    c.eq(f"{name} timeline events", json.dumps(free_runs(got), sort_keys=True), json.dumps(free_runs(want), sort_keys=True))
    if "device" in est:
        d = est["device"]
        c.eq(f"{name} verdict", (page["verdict"]["fits"], page["verdict"]["headroom"]),
             (str(d["fits"]).lower(), str(d["headroom_bytes"])))
        fit_fields = {k: v for k, v in fields.items() if k != "batch"}
        f = cli(trainmem, "fit", fit_fields, cwd)
        print(f"{name}: page fit largest {page['fit_largest']}, CLI {f['largest']}")
        c.eq(f"{name} fit largest", page["fit_largest"], f["largest"] if f["largest"] is not None else "none")
        c.eq(f"{name} fit table", page["fit_table"], cli(trainmem, "fit", fit_fields, cwd, "table"))
        c.eq(f"{name} fit JSON", json.dumps(numbers(page["fit_answer"]["fit"]), sort_keys=True),
             json.dumps(numbers(f), sort_keys=True))
    else:
        c.eq(f"{name} verdict", page["verdict"], None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainmem", required=True)
    ap.add_argument("--page", required=True, help="the built page's folder (<build>/web)")
    ap.add_argument("--out", required=True, help="folder for the screenshots")
    ap.add_argument("--web-built", default="ON", help="OFF: emscripten was not found when configuring")
    a = ap.parse_args()
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        skip("chromium is not installed (bash scripts/setup.sh installs Debian's chromium)")
    if not os.path.isfile(os.path.join(a.page, "trainmem.js")):
        if a.web_built != "ON":
            skip("the page is not built: emscripten is not installed (bash scripts/setup.sh, then make web)")
        raise SystemExit(f"FAIL: {a.page}/trainmem.js is missing: make web did not build the page")
    try:
        import websocket  # noqa: F401
    except ImportError:
        skip("python3-websocket is not installed (bash scripts/setup.sh installs it)")
    trainmem = os.path.abspath(a.trainmem)
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="trainmem-web-")
    c = Check()
    b = Browser(os.path.join(work, "profile"))
    server = None
    try:
        url = "file://" + os.path.abspath(os.path.join(a.page, "index.html"))
        load(b, url)
        # 1. a preset with every other field at its default
        fields = {"model": "pythia-160m"}
        compare(c, "preset pythia-160m", set_and_read(b, fields), trainmem, fields, work, b)
        # 2. LoRA on a GPU: the verdict and fit's answer too
        page = set_and_read(b, LORA_GPU)
        compare(c, "tinyllama-1.1b LoRA on rtx-4090", page, trainmem, LORA_GPU, work, b)
        c.eq("the page's command line", page["cli"],
             "trainmem estimate --model tinyllama-1.1b --batch 2 --seq 512 --precision bf16 --lora "
             "r=16,alpha=32,targets=q_proj,v_proj --gpu rtx-4090")
        b.screenshot(os.path.join(a.out, "screenshot.png"))
        # 2b. plan over a cluster: the page's plan table is the CLI's
        plan_fields = {"model": "tinyllama-1.1b", "seq": "512"}
        set_and_read(b, plan_fields)
        b.js("document.getElementById('plan-box').open = true; document.getElementById('plan-gpus').value = "
             "'8xh100-80gb'; document.getElementById('plan-global-batch').value = '16'; "
             "document.getElementById('plan-run').click(); true")
        b.wait("['ready', 'error'].includes(document.body.dataset.plan)", "the plan")
        page_plan = b.js("document.getElementById('plan-table').textContent")
        want = subprocess.run([trainmem, "plan", "--model", "tinyllama-1.1b", "--seq", "512", "--gpus", "8xh100-80gb",
                               "--global-batch", "16"], cwd=work, capture_output=True, text=True).stdout
        c.eq("plan table", page_plan, want)
        # 3. a pasted config.json (the CLI reads the same text from a file of the same name)
        src = os.path.join(os.path.dirname(__file__), "..", "..", "data", "models", "opt-125m.json")
        with open(src) as f:
            text = f.read()
        with open(os.path.join(work, "config.json"), "w") as f:
            f.write(text)
        fields = {"model": "config.json", "batch": "4", "seq": "256", "checkpointing": "full"}
        page = set_and_read(b, {**fields, "config": text})
        compare(c, "pasted config.json", page, trainmem, fields, work, b)
        b.screenshot(os.path.join(a.out, "pasted-config.png"))
        # 4. a bad value: the page says what the CLI says
        page = set_and_read(b, {"model": "gpt2", "batch": "0"})
        p = subprocess.run([trainmem, "estimate", "--model", "gpt2", "--batch", "0"], capture_output=True, text=True)
        c.eq("error state", page["state"], "error")
        c.eq("error message", page["error"], p.stderr.strip())
        # 5. the same page served by `trainmem serve`
        server = subprocess.Popen([trainmem, "serve", "--port", "0", "--root", a.page], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        line = server.stdout.readline()
        if "http://" not in line:
            raise SystemExit(f"FAIL: trainmem serve said {line!r} {server.stderr.read() if server.poll() is not None else ''}")
        served = line.split(" at ", 1)[1].split(" ", 1)[0]
        with urllib.request.urlopen(served + "app.js", timeout=30) as r:
            c.eq("served app.js", r.read().decode(), open(os.path.join(a.page, "app.js")).read())
        for bad in ["../CMakeLists.txt", "%2e%2e/CMakeLists.txt", "nothing.js", "web-cmake/Makefile"]:
            try:
                urllib.request.urlopen(served + bad, timeout=30)
                code = 200
            except urllib.error.HTTPError as e:
                code = e.code
            c.eq(f"served {bad}", code, 404)
        load(b, served)
        fields = {"model": "gpt2", "batch": "2", "seq": "128", "gpu": "t4"}
        compare(c, "served gpt2 on t4", set_and_read(b, fields), trainmem, fields, work, b)
        b.screenshot(os.path.join(a.out, "served.png"))
    finally:
        b.close()
        if server:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{c.passed} passed, {c.failed} failed")
    print(f"screenshots: {a.out}")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
