#!/usr/bin/env python3
"""Runs the hostile inputs of tests/hostile/cases.txt through the trainmem executable.

  run_hostile.py --trainmem build/trainmem                 every case, one line each, exit 1 if any fails
  run_hostile.py --trainmem build/trainmem --case 7        the 7th case only (what each ctest test runs)
  run_hostile.py --list                                    "<index> <name>" per case (for CMake)
  run_hostile.py --generate DIR                            writes the generated inputs into DIR and exits

Each case runs in this folder with a timeout (20 s); it passes when it exits (no signal, no timeout) with an
expected code, and, when it exits with an error (2 or more) or prints to stderr, stderr starts with
"trainmem: ", is valid UTF-8 (error.h: a message echoes a byte that is not as text) and never says "internal
error" (nor carries a sanitizer's report, when the executable is a sanitized build). Exit 1 (the step does not
fit) answers on stdout and needs no stderr.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def json_array(head, item, count):
    """A writer of `head`, `count` copies of `item` joined by commas, then `]}` and a newline."""
    def write(f):
        f.write(head)
        f.write(b",".join([item] * count))
        f.write(b"]}\n")
    return write


def mlp_layers(count):
    """An mlp layer stack (src/config/stack_config.cc) of `count` linear layers of width 8."""
    return json_array(b'{"model_type": "mlp", "input": 8, "layers": [', b'{"linear":8}', count)


def objects_in_array(count):
    """A gpt2 config with an array of `count` empty objects under a key nothing reads."""
    return json_array(b'{"model_type": "gpt2", "n_layer": 2, "unread": [', b"{}", count)


# Inputs too big for git, written into $WORK on first use: name -> writer.
GENERATED = {
    "mlp_1m_layers.json": mlp_layers(1_000_000),              # 13 MB
    "objects_in_array_1m.json": objects_in_array(1_000_000),  # 3 MB
}

SANITIZER_MARKS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error:")


class Case:
    def __init__(self, index, lineno, text):
        self.index, self.lineno, self.text = index, lineno, text
        parts = text.split(" ;; ")
        head, checks = parts[0], parts[1:]
        codes, _, rest = head.strip().partition(" ")
        self.codes = [int(c) for c in codes.split("|")]
        # \xNN survives shlex (which would take the backslash as an escape) and is decoded in argv()
        self.args = shlex.split(rest.replace("\\x", "\\\\x"))
        self.stdout_lacks = []
        self.stderr_max_bytes = None
        for c in checks:
            key, _, value = c.partition(":")
            key = key.strip()
            if key == "stdout-lacks":
                self.stdout_lacks.append(re.compile(value.strip(), re.M))
            elif key == "stderr-max-bytes":
                self.stderr_max_bytes = int(value)
            else:
                raise ValueError(f"cases.txt:{lineno}: unknown check {key!r}")

    @property
    def name(self):
        words = []
        for a in self.args:
            a = a.replace("$WORK/", "")
            a = a.lstrip("/") if a.startswith("/dev/") else os.path.basename(a)
            a = re.sub(r"\.json$", "", a)
            a = re.sub(r"\\x([0-9a-fA-F]{2})", r"x\1", a)
            words.append(re.sub(r"[^A-Za-z0-9]+", "_", a).strip("_"))
        name = "_".join(w for w in words if w and w not in ("model", "set"))
        return f"{self.index:02d}_{name[:60].rstrip('_')}"

    def argv(self, work):
        out = []
        for a in self.args:
            a = a.replace("$WORK", work)
            b = a.encode("utf-8")
            b = re.sub(rb"\\x([0-9a-fA-F]{2})", lambda m: bytes([int(m.group(1), 16)]), b)
            out.append(b)
        return out


def read_cases(path):
    cases = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            cases.append(Case(len(cases) + 1, lineno, line))
    return cases


def generate(work, names=None):
    os.makedirs(work, exist_ok=True)
    for name, write in GENERATED.items():
        if names is not None and name not in names:
            continue
        path = os.path.join(work, name)
        if os.path.exists(path):
            continue
        fd, tmp = tempfile.mkstemp(dir=work, prefix=name + ".")
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # atomic: a parallel ctest never reads half a file


def run(case, exe, work, timeout):
    used = [n for n in GENERATED if any(f"$WORK/{n}" in a for a in case.args)]
    generate(work, used)
    argv = [os.fsencode(exe)] + case.argv(work)
    start = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=HERE, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"no exit within {timeout} s"], time.monotonic() - start, None
    took = time.monotonic() - start
    err = p.stderr.decode("utf-8", "replace")
    out = p.stdout.decode("utf-8", "replace")
    fails = []
    if p.returncode < 0:
        fails.append(f"killed by signal {-p.returncode}")
    elif p.returncode not in case.codes:
        fails.append(f"exit code {p.returncode}, expected {'|'.join(map(str, case.codes))}")
    # exit 1 (the step does not fit) answers on stdout; an error (2, 3) must say why on stderr
    if (p.returncode >= 2 or err) and not err.startswith("trainmem: "):
        fails.append("stderr does not start with \"trainmem: \"")
    try:
        p.stderr.decode("utf-8")
    except UnicodeDecodeError as e:
        fails.append(f"stderr is not valid UTF-8 ({e.reason} at byte {e.start})")
    if "internal error" in err:
        fails.append("stderr says \"internal error\"")
    if any(m in err for m in SANITIZER_MARKS):
        fails.append("a sanitizer reported an error")
    if case.stderr_max_bytes is not None and len(p.stderr) > case.stderr_max_bytes:
        fails.append(f"stderr has {len(p.stderr)} bytes, more than {case.stderr_max_bytes}")
    for r in case.stdout_lacks:
        m = r.search(out)
        if m:
            line = out[out.rfind("\n", 0, m.start()) + 1:out.find("\n", m.end())]
            fails.append(f"stdout matches /{r.pattern}/: {line.strip()}")
    return fails, took, (p.returncode, out, err)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainmem", help="the trainmem executable")
    ap.add_argument("--manifest", default=os.path.join(HERE, "cases.txt"))
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "trainmem-hostile"),
                    help="folder for generated inputs ($WORK)")
    ap.add_argument("--case", type=int, help="run only this case (1-based, as --list numbers them)")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--generate", metavar="DIR", help="write the generated inputs into DIR and exit")
    a = ap.parse_args()

    if a.generate:
        generate(a.generate)
        for n in GENERATED:
            print(os.path.join(a.generate, n))
        return 0
    cases = read_cases(a.manifest)
    if a.list:
        for c in cases:
            print(c.index, c.name)
        return 0
    if not a.trainmem:
        ap.error("--trainmem is required")
    exe = os.path.abspath(a.trainmem)
    work = os.path.abspath(a.work)
    if a.case is not None:
        cases = [c for c in cases if c.index == a.case]
        if not cases:
            ap.error(f"no case {a.case}")
    failed = 0
    for c in cases:
        fails, took, res = run(c, exe, work, a.timeout)
        status = "FAIL" if fails else "ok  "
        print(f"{status} {c.index:2d} ({took:5.2f} s) cases.txt:{c.lineno}: {c.text.split(' ;; ')[0]}")
        if fails:
            failed += 1
            for f in fails:
                print(f"       {f}")
            if res:
                rc, out, err = res
                for label, text in (("stderr", err), ("stdout", out)):
                    text = text.strip()
                    if text:
                        lines = text.splitlines()
                        shown = "\n         ".join(l[:300] for l in lines[:8])
                        more = f"\n         ... ({len(lines) - 8} more lines)" if len(lines) > 8 else ""
                        print(f"       {label}: {shown}{more}")
    if len(cases) > 1:
        print(f"{len(cases) - failed} of {len(cases)} hostile cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
