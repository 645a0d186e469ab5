"""Every config key a user can set is documented in the README's key tables."""

from pathlib import Path

from tuneforge.config.schema import key_index

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_key_is_in_the_readme():
    text = README.read_text()
    missing = [k for k in key_index() if f"`{k}`" not in text]
    assert not missing, f"document these keys in README.md: {missing}"
