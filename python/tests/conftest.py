# Shared by the Python module's tests: the trainmem executable they compare with (TRAINMEM_CLI, set by ctest),
# and the repository's preset files.
import json
import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def cli_path():
    path = os.environ.get("TRAINMEM_CLI") or str(REPO / "build" / "trainmem")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no trainmem executable at {path} (set TRAINMEM_CLI)")
    return path


def run_cli(*args):
    """(exit code, stdout, stderr) of the trainmem executable."""
    p = subprocess.run([cli_path(), *map(str, args)], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def cli_json(*args):
    rc, out, err = run_cli(*args, "--format", "json")
    assert rc in (0, 1), err
    return json.loads(out)


def cli_error(*args):
    """The CLI's message for bad input: its stderr's one line after "trainmem: ", with exit code 2."""
    rc, out, err = run_cli(*args)
    assert rc == 2, (rc, out, err)
    lines = [l for l in err.splitlines() if not l.startswith("trainmem: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("trainmem: "), err
    return lines[0][len("trainmem: "):]


def preset_config(name):
    """A preset's config.json keys (data/models/<name>.json), as a user's dict or to_dict() would give them."""
    return json.loads((REPO / "data" / "models" / f"{name}.json").read_text())
