"""The README's quickstart runs as written (offline, no key)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "[calculator -> 42]" in proc.stdout and "ok=True" in proc.stdout
    assert "state='offline'" in proc.stdout
