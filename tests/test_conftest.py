"""The shared fixtures keep tests apart: an environment variable a test sets stays in that test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

LEAKING_TESTS = textwrap.dedent("""
    import os

    from datasets import Dataset

    from tuneforge.paths import tuneforge_home


    def test_a_data_test_with_workers(monkeypatch, tmp_path):
        monkeypatch.setenv("TUNEFORGE_HOME", str(tmp_path / "private"))
        Dataset.from_dict({"x": [1, 2, 3, 4]}).map(lambda row: row, num_proc=2)


    def test_the_next_test_sees_the_session_home():
        assert str(tuneforge_home()) == os.environ["OUTER_HOME"]
""")


def test_a_setenv_before_a_multiprocess_map_does_not_leak_into_later_tests(tmp_path):
    # a session of its own, with the suite's conftest, so that what leaks cannot reach this session
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_leak.py").write_text(LEAKING_TESTS)
    home = str(tmp_path / "session-home")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "TUNEFORGE_HOME": home, "OUTER_HOME": home},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout
