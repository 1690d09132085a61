"""The README quickstart runs exactly as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_quickstart_runs_as_written() -> None:
    section = README.read_text().split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code, "README has a ```python block under ## Quickstart"
    result = subprocess.run([sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\d+ MiB mapped, \d+ KiB waste, \d+/3 page needs met ahead\n", result.stdout), result.stdout
