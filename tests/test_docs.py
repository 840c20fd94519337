"""Docs that cannot go stale: every fenced `robustbn ...` command in README.md, docs/ and the
examples' READMEs, and every example in the commands' own --help, parses with the real
argument parser (nothing runs; flags spelt out, `--where`/`--compare`/`--set` keys scenario
fields); a command in prose names a real command and its real flags; every relative link and
image in them resolves, anchors included."""

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from robustbn.cli import build_parser
from robustbn.cli.common import UsageError, parse_where
from robustbn.matrix import FIELDS, MatrixError, parse_override

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(p for folder in ("docs", "examples") for p in (ROOT / folder).rglob("*.md")
                                     if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))])
SHELL = {"bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.S | re.M)
OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "&>"}


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) of every shell code block, continuation lines joined."""
    found = []
    for block in FENCE.finditer(text):
        if block.group(1) not in SHELL:
            continue
        first = text.count("\n", 0, block.start(2)) + 1
        pending, start = "", None
        for i, line in enumerate(block.group(2).splitlines()):
            start = first + i if start is None else start
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            found.append((start, pending + line))
            pending, start = "", None
    return found


def commands(line: str) -> list[list[str]]:
    """The argument lists of the `robustbn` commands of one shell line: comments stripped,
    split at pipes, `&&`, `;` and redirections, shell variables read as 0 (`--shard
    $SLURM_ARRAY_TASK_ID/8` is `0/8`)."""
    line = re.sub(r"\$\{?\w+\}?", "0", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    found, current, skip = [], [], False
    for token in [*lexer, ";"]:
        if token in OPERATORS or set(token) <= set("|&;<>"):
            if current:
                found.append(current)
            current, skip = [], token in {">", ">>", "<", "2>", "&>"}  # the next word is a file
            continue
        if skip:
            skip = False
            continue
        current.append(token)
    return [c[1:] for c in found if c and Path(c[0]).name == "robustbn"]


def strict_parser() -> argparse.ArgumentParser:
    """The real parser with abbreviated flags refused, in every command: a doc spells each flag
    out (`--worst` parses as `--worst-case` today, and fails the day another flag starts so).
    Users may still abbreviate."""
    ap = build_parser()
    for parser in [ap, *ap.commands.values()]:
        parser.allow_abbrev = False
    return ap


def parse(argv: list[str]) -> str | None:
    """None when the parser accepts argv (or it asks for --help or --version) and every
    `--where`, `--compare` and `--set` names a scenario field, else the message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = strict_parser().parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip() or f"exit status {e.code}"
        return None
    try:  # what the command checks first, before it opens a store or a file
        parse_where(getattr(args, "where", None) or [])
        parse_where(getattr(args, "compare", None) or [], "--compare")
        for text in getattr(args, "set", None) or []:
            key, _ = parse_override(text)
            if key not in FIELDS:
                return f"--set {key}: not a scenario field"
    except (UsageError, MatrixError) as e:
        return str(e)
    return None


def documented_commands():
    for path in DOCS:
        for number, line in shell_lines(path.read_text()):
            for argv in commands(line):
                yield pytest.param(argv, id=f"{path.relative_to(ROOT)}:{number}")


def test_the_docs_hold_commands():
    found = {p.id.split(":")[0] for p in documented_commands()}
    assert {"README.md", "docs/guide/scenarios.md", "docs/guide/clusters.md"} <= found


@pytest.mark.parametrize("argv", list(documented_commands()))
def test_every_documented_command_parses(argv, request):
    where = request.node.callspec.id
    problem = parse(argv)
    assert problem is None, f"{where}: robustbn {shlex.join(argv)}: {problem}"


INLINE = re.compile(r"`(?:\S*/)?robustbn ([a-z][\w-]*)([^`\n]*)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def inline_problems(path: Path) -> list[str]:
    """Commands in prose (`robustbn merge --db TARGET STORE...`) are synopses, not command lines:
    each names a command, and each of its flags is one of that command's, spelt out."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    commands, problems = strict_parser().commands, []
    for m in INLINE.finditer(text):
        where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        if m.group(1) not in commands:
            problems.append(f"{where}: no command {m.group(1)}")
            continue
        options = commands[m.group(1)]._option_string_actions
        problems += [f"{where}: robustbn {m.group(1)} has no {flag}" for flag in FLAG.findall(m.group(2))
                     if flag not in options]
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_in_prose_names_real_flags(path):
    assert inline_problems(path) == []


def help_examples():
    ap = build_parser()
    for name, sub in [("robustbn", ap), *ap.commands.items()]:
        for line in (sub.epilog or "").split("examples:", 1)[-1].splitlines():
            for argv in commands(line.strip()):
                yield pytest.param(argv, id=f"{name} --help: {shlex.join(argv)}"[:120])


def test_every_command_has_examples_in_its_help():
    named = {p.id.split(" --help")[0] for p in help_examples()}
    assert named == {"robustbn", *build_parser().commands}


@pytest.mark.parametrize("argv", list(help_examples()))
def test_every_help_example_parses(argv):
    problem = parse(argv)
    assert problem is None, f"robustbn {shlex.join(argv)}: {problem}"


@pytest.mark.parametrize("line, expected", [
    ("robustbn results --format csv > results.csv  # a comment", [["results", "--format", "csv"]]),
    ("robustbn run x.toml --shard $SLURM_ARRAY_TASK_ID/8 --db r/s${I}.sqlite",
     [["run", "x.toml", "--shard", "0/8", "--db", "r/s0.sqlite"]]),
    ("ray start --head && .venv/bin/robustbn list 'a b.toml' | head", [["list", "a b.toml"]]),
    ("robustbn results --worst-case --format csv>w.csv; robustbn plot worst-case --out w.png",
     [["results", "--worst-case", "--format", "csv"], ["plot", "worst-case", "--out", "w.png"]]),
    ("#SBATCH --array=0-7", []),
    ("pip install 'robustbn[ray]'", []),
])
def test_commands_are_read_as_the_shell_reads_them(line, expected):
    assert commands(line) == expected


def test_continuation_lines_are_joined_and_a_bad_flag_is_caught():
    text = "x\n```bash\nrobustbn run a.toml \\\n    --jobs 2\nrobustbn results --wehre f=3\n```\n"
    lines = shell_lines(text)
    assert lines == [(3, "robustbn run a.toml      --jobs 2"), (5, "robustbn results --wehre f=3")]
    assert parse(commands(lines[0][1])[0]) is None
    assert "unrecognized arguments: --wehre" in parse(commands(lines[1][1])[0])
    assert "invalid choice" in parse(["plot", "bars", "--out", "a.png"])


@pytest.mark.parametrize("argv, message", [
    (["results", "--worst", "--where", "gamma=0.0"], "unrecognized arguments: --worst"),  # users may; docs may not
    (["run", "a.toml", "--job", "2"], "unrecognized arguments: --job"),
    (["results", "--where", "gama=0.0"], "--where gama: not a scenario field"),
    (["results", "--compare", "bnagg=mean", "bn_agg=nnm+median"], "--compare bnagg: not a scenario field"),
    (["list", "a.toml", "--set", "round=100"], "--set round: not a scenario field"),
    (["run", "a.toml", "--set", "rounds"], "expected key=value"),
])
def test_an_abbreviated_flag_or_an_unknown_field_is_caught(argv, message):
    assert message in parse(argv)


def test_users_may_still_abbreviate():
    """Only the docs are held to full flags: the command itself behaves as before."""
    assert build_parser().parse_args(["results", "--worst"]).worst_case is True


def test_commands_in_prose_are_checked(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    page = tmp_path / "a.md"
    page.write_text("`robustbn merge --db TARGET STORE...` and `robustbn run` and `robustbn.run(sc)`\n"
                    "```bash\nrobustbn plot --nope\n```\n"
                    "`robustbn results --worst --status done` `robustbn mrege x` `.venv/bin/robustbn list f --sets x`\n")
    assert inline_problems(page) == [
        "a.md:5: `robustbn results --worst --status done`: robustbn results has no --worst",
        "a.md:5: `robustbn mrege x`: no command mrege",
        "a.md:5: `.venv/bin/robustbn list f --sets x`: robustbn list has no --sets"]


# ---- names ------------------------------------------------------------------------------

NAME = re.compile(r"`@?((?:aggregators|attacks|robustbn)(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`")
# docs/results.md and docs/performance.md join once their stale names are fixed (results.md:586
# `aggregators.testing.measure_kappa`, now robustbn.kappa; performance.md:79 `robustbn.norm.HybridNorm`,
# now robustbn.protocols.hbn)
NAMED = DOCS


def resolves(name: str) -> bool:
    """A dotted name is a module, or an attribute path from the longest module it starts with
    (a module that needs an extra not installed here, flwr or ray, cannot be told: it passes)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in {"aggregators", "attacks", "robustbn"}:
                return True
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def stale_names(path: Path) -> list[str]:
    """Python names in inline code (`robustbn.kappa.measure_kappa(...)`, `@attacks.register`)
    that no longer resolve: a function moved, a class renamed."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    return [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}"
            for m in NAME.finditer(text) if not resolves(m.group(1))]


@pytest.mark.parametrize("path", NAMED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_name_in_the_docs_resolves(path):
    assert stale_names(path) == []


def test_a_moved_name_is_found(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    page = tmp_path / "a.md"
    page.write_text("`robustbn.kappa.measure_kappa(spec, n, f)` `@aggregators.register` `robustbn.protocols`\n"
                    "`aggregators.testing.measure_kappa` `robustbn.cli.nothing(x)` `robustbn 0.1.0`\n")
    assert stale_names(page) == ["a.md:2: aggregators.testing.measure_kappa", "a.md:2: robustbn.cli.nothing"]


# ---- links ------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img[^>]+src=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", text, re.M)}


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image outside code."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1) or m.group(2)) for m in LINK.finditer(text)]


def broken(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading #{anchor} in {resolved.name}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(path):
    assert broken(path) == []


def test_the_link_check_finds_broken_links(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "img.png").write_bytes(b"")
    (tmp_path / "b.md").write_text("# Who computes, in a round?\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#who-computes-in-a-round) ![i](img.png) [web](https://x.org/y) `[no](code.md)`\n"
                    "```\n[in code](gone.md)\n```\n[gone](gone.md) ![gone](gone.png) [bad](b.md#nope) [self](#x)\n"
                    "## X\n")
    assert broken(page) == ["a.md:5: gone.md: no such file", "a.md:5: gone.png: no such file",
                            "a.md:5: b.md#nope: no heading #nope in b.md"]


def test_slugs_are_githubs():
    assert slug("`robustbn.run(scenario)`") == "robustbnrunscenario"
    assert slug("How robust is it: the measured (f, κ)") == "how-robust-is-it-the-measured-f-κ"
    assert slug("Array jobs (Slurm, Kubernetes indexed jobs)") == "array-jobs-slurm-kubernetes-indexed-jobs"


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("benchmarks/*.sh"),
                                                                             *ROOT.glob("docs/*.sh"), ROOT / "dev.sh"]))
def test_the_shell_scripts_parse(script):
    """Scripts no test runs whole (a GPU lease's, the CPU lanes'): bash reads each through."""
    out = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_cpu_lanes_script_refuses_an_unknown_command():
    out = subprocess.run(["bash", "benchmarks/cpu_lanes.sh", "go"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "Q": "/nonexistent-lanes-dir-is-not-made"})
    assert out.returncode == 2 and "usage: bash benchmarks/cpu_lanes.sh start|freeze|thaw|stop|halt|status" in out.stderr
