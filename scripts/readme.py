#!/usr/bin/env python3
"""Keeps the README's example outputs true.

Every block in README.md written as

    <!-- run: trainmem estimate --model gpt2 -->
    ```text
    ...output...
    ```

holds the real output of that command (run from the repository root with build/trainmem). A command may end in
`| tail -N` or `| head -N`: the block then holds the output's last (first) N lines. With --write the blocks are regenerated; with --check
(a ctest) the script fails when any block is stale.

A picture the README shows is made the same way: a line

    <!-- plot: trainmem timeline --model gpt2 --gpu rtx-4090 --plot docs/img/timeline-gpt2.svg -->

says which command draws the committed file after --plot; --write redraws it, --check compares it byte for byte.
"""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- run: (?P<cmd>[^>]*?) -->\n```text\n)(?P<out>.*?)(```)", re.S)
PLOT = re.compile(r"<!-- plot: (?P<cmd>trainmem [^>]*?--plot (?P<path>\S+)[^>]*?) -->")


def run(cmd: str, exe: Path) -> str:
    cmd, _, tail = cmd.partition(" | tail -")
    cmd, _, head = cmd.partition(" | head -")
    args = cmd.split()
    assert args[0] == "trainmem", cmd
    proc = subprocess.run([str(exe)] + args[1:], cwd=ROOT, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode not in (0, 1, 2):  # 1: with --gpu, the step does not fit
        raise SystemExit(f"readme: `{cmd}` exited {proc.returncode}:\n{out}")
    out = out if out.endswith("\n") else out + "\n"
    lines = out.splitlines(keepends=True)
    if head:
        lines = lines[:int(head)]
    return "".join(lines[-int(tail):] if tail else lines)


def draw(cmd: str, path: str, exe: Path) -> bytes:
    """The bytes `cmd` writes to the file after --plot (drawn into a temporary file)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / Path(path).name
        args = cmd.split()
        args[args.index("--plot") + 1] = str(out)
        proc = subprocess.run([str(exe)] + args[1:], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode not in (0, 1) or not out.exists():
            raise SystemExit(f"readme: `{cmd}` exited {proc.returncode}:\n{proc.stderr}")
        return out.read_bytes()


def main() -> int:
    mode = sys.argv[1]
    exe = Path(sys.argv[2]).resolve()
    readme = ROOT / "README.md"
    text = readme.read_text()
    stale = []

    def replace(m: re.Match) -> str:
        out = run(m.group("cmd"), exe)
        if out != m.group("out"):
            stale.append(m.group("cmd"))
        return m.group(1) + out + m.group(4)

    new = BLOCK.sub(replace, text)
    for m in PLOT.finditer(text):
        picture = draw(m.group("cmd"), m.group("path"), exe)
        target = ROOT / m.group("path")
        if not target.exists() or target.read_bytes() != picture:
            stale.append(m.group("cmd"))
            if mode == "--write":
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(picture)
    if mode == "--write":
        readme.write_text(new)
        print(f"readme: {len(stale)} block(s) updated")
        return 0
    if stale:
        print("README.md shows outdated output for:\n  " + "\n  ".join(stale))
        print("run: python3 scripts/readme.py --write build/trainmem")
        return 1
    print(f"readme: {len(BLOCK.findall(text))} example outputs and {len(PLOT.findall(text))} pictures are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
