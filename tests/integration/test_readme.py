"""The README's protocol examples run as written, from the repository's root."""

import os
import re
import subprocess

from stockade_testlib import REPO_ROOT
from serve_helpers import clean_env


def readme_block(lang):
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## `stockade serve` and the protocol"):]
    m = re.search(r"```" + lang + r"\n(.*?)```", section, re.S)
    assert m, f"no {lang} example in the README's protocol section"
    return m.group(1)


def test_python_example_runs_as_written(stockade):
    code = readme_block("python")
    assert len(code.strip().splitlines()) <= 12, "the example is meant to be short"
    env = clean_env()
    env.pop("PYTHONPATH", None)
    if os.path.realpath(stockade) != os.path.realpath(os.path.join(REPO_ROOT, "stockade")):
        code = code.replace('"./stockade"', repr(stockade))
    cp = subprocess.run(["/usr/bin/python3", "-c", code], cwd=REPO_ROOT, env=env,
                        capture_output=True, timeout=120)
    out = cp.stdout.decode()
    assert cp.returncode == 0, cp.stderr.decode()[-3000:]
    lines = out.splitlines()
    assert lines[0] == "TOOL_TIMEOUT False timeout b'hello\\n'", out
    assert "OutputChunk(stream='stdout', data=b'1\\n')" in out, out
    assert lines[-1].startswith("CallResult(") and "class_='OK'" in lines[-1], out
