"""The README's install and test commands are true for a user on any machine, `.ci/run` runs its test command, and its
contents link to its headings."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
QUICKSTART = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _test_command() -> str:
    after = QUICKSTART.split("Test command (`.ci/run` runs exactly this", 1)[1]
    return _blocks(after)[0].strip()


def test_ci_runs_exactly_the_readmes_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert _test_command() == "pip install -e '.[test]' && python -m pytest"
    assert ci[-1] == _test_command()


def test_the_user_commands_pin_no_torch_build_and_name_the_accepted_range():
    commands = "\n".join(_blocks(QUICKSTART))
    assert "torch==" not in QUICKSTART  # a pin that fits one machine's index belongs in .ci/run, not here
    assert commands.splitlines()[0] == "pip install -e . && pipesched demo"
    torch = re.search(r'"(torch[<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"`{torch}`" in QUICKSTART and f"pip install '{torch}' --index-url https://download.pytorch.org/whl/cpu" \
        in commands
    assert "https://pytorch.org/get-started/locally/" in QUICKSTART


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_contents_goes_to_a_heading():
    text = README
    anchors = {_slug(h) for h in re.findall(r"^#{2,4} (.+)$", text, flags=re.M)}
    contents = text[text.index("## Contents"):text.index("## Quickstart")]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert len(links) >= 20 and set(links) <= anchors, sorted(set(links) - anchors)
