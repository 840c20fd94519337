import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
ENGINE = ROOT / "docs" / "guide" / "engine.md"


def test_quickstart_is_exactly_two_commands():
    section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["./dev.sh demo", "./dev.sh test"]


def test_engine_example_runs_as_written(capsys):
    code = re.search(r"```python\n(import robustbn\n.*?)```", ENGINE.read_text(), re.S).group(1)
    exec(compile(code, str(ENGINE), "exec"), {})
    out = capsys.readouterr().out
    assert "'round': 60" in out and "features.1" in out


def test_the_tour_runs_as_written(tmp_path):
    """README's tensor example gives one finite aggregate, and its scenario file expands into
    the number of runs it says."""
    import torch

    from robustbn.matrix import load

    text = README.read_text()
    code = re.search(r"```python\n(import torch, aggregators, attacks\n.*?)```", text, re.S).group(1)
    *body, last = code.strip().splitlines()
    scope = {}
    exec(compile("\n".join(body) + "\nresult = " + last, str(README), "exec"), scope)
    assert scope["result"].shape == (1000,) and torch.isfinite(scope["result"]).all()
    toml = re.search(r"```toml\n(.*?)```", text.split("## A tour", 1)[1], re.S).group(1)
    said = int(re.search(r"this one into (\d+) runs", text).group(1))
    (tmp_path / "tour.toml").write_text(toml)
    assert len(load(tmp_path / "tour.toml", [])[1]) == said


def test_the_readme_stays_a_landing_page_with_every_guide_page_linked():
    """Under 200 lines; the rest is in docs/guide/, whose every page the README and the guide's
    index link (a page nobody links is a page nobody finds)."""
    text = README.read_text()
    assert len(text.splitlines()) < 200
    index = (ROOT / "docs" / "guide" / "README.md").read_text()
    for page in sorted((ROOT / "docs" / "guide").glob("*.md")):
        if page.name != "README.md":
            assert f"(docs/guide/{page.name})" in text, f"README.md does not link docs/guide/{page.name}"
            assert f"]({page.name})" in index, f"docs/guide/README.md does not link {page.name}"
