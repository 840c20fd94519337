import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_quickstart_is_exactly_two_commands():
    section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["./dev.sh demo", "./dev.sh test"]


def test_engine_example_runs_as_written(capsys):
    code = re.search(r"```python\n(import robustbn\n.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "'round': 60" in out and "features.1" in out
