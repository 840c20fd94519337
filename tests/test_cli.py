import subprocess
import sys

import pytest

from robustbn.cli import main
from robustbn.messages import ATTACKS, DEFENSES, attack_defense_table


def test_demo_prints_the_attack_defense_table(capsys):
    assert main(["demo", "--d", "500"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("attack"))
    assert header.split()[1:] == DEFENSES
    assert [line.split()[0] for line in out.splitlines()[-len(ATTACKS):]] == ATTACKS


def test_demo_table_shows_what_the_papers_show():
    t = attack_defense_table(d=2000, spread=0.2)
    assert t["none", "mean"] == pytest.approx(0.0, abs=1e-6)
    # undefended averaging is wrecked by noise; median-based defenses are not
    assert t["gaussian", "mean"] > 10 * t["gaussian", "nnm+median"]
    assert all(t[a, d] < 1.0 for a in ATTACKS for d in ["median", "trmean", "nnm+median", "nnm+trmean"])


def test_bad_demo_arguments_are_a_clear_error_not_a_traceback():
    p = subprocess.run([sys.executable, "-m", "robustbn.cli", "demo", "--f", "5"], capture_output=True, text=True)
    assert p.returncode == 2 and "n > 2f + 2" in p.stderr and "Traceback" not in p.stderr


def test_version():
    p = subprocess.run([sys.executable, "-m", "robustbn.cli", "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("robustbn ")
