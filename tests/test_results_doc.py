"""docs/results.md and docs/report/index.html are generated: `./dev.sh docs --check` (python
docs/tables.py --cog --check, --page --check) passes on the committed files and fails on stale
ones; the verdict words come from the code."""

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results.md"
TABLES = ROOT / "docs" / "tables.py"

pytest.importorskip("cogapp", reason="cogapp is not installed (the test extra)")


def check(*paths: Path, what: str = "--cog") -> subprocess.CompletedProcess:
    """docs/tables.py WHAT --check PATH...: --cog checks results.md files, --page pages' directories."""
    return subprocess.run([sys.executable, str(TABLES), what, "--check", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_results_md_is_what_results_csv_gives_and_a_stale_number_fails(tmp_path):
    text = RESULTS.read_text(encoding="utf-8")
    # the leaderboard's block alone (the rest of the file is checked as shipped), its first
    # generated cell changed by a tenth of a point
    start = text.index("<!-- [[[cog tables.leaderboard() ]]] -->")
    block = text[start:text.index("<!-- [[[end]]] -->", start) + len("<!-- [[[end]]] -->")]
    match = re.compile(r"\| (\d+\.\d) \| \[").search(block)
    stale = tmp_path / "results.md"
    stale.write_text(block[:match.start(1)] + f"{float(match.group(1)) + 0.1:.1f}" + block[match.end(1):] + "\n",
                     encoding="utf-8")
    done = check(RESULTS, stale)  # one process: the runs are read once
    out = done.stdout + done.stderr
    assert done.returncode != 0 and f"Checking {stale}  (changed)" in out and "is stale" in out
    assert f"Checking {RESULTS}  (changed)" not in out, f"docs/results.md is stale (run ./dev.sh docs):\n{out[-3000:]}"


def test_the_shipped_page_is_what_results_csv_gives_and_a_stale_one_fails(tmp_path):
    shipped = ROOT / "docs" / "report"
    # the leaderboard's first worst-case cell, a tenth of a point off
    html = (shipped / "index.html").read_text(encoding="utf-8")
    table = html.index('<table id="leaderboard">')
    match = re.compile(r'class="num">(\d+\.\d)</td><td[^>]*>\[').search(html, table)
    stale = html[:match.start(1)] + f"{float(match.group(1)) + 0.1:.1f}" + html[match.end(1):]
    (tmp_path / "index.html").write_text(stale, encoding="utf-8")
    done = check(shipped, tmp_path, what="--page")
    assert done.returncode == 1 and f"{tmp_path / 'index.html'} is stale" in done.stderr
    assert f"{shipped / 'index.html'} is stale" not in done.stderr, \
        f"docs/report/index.html is stale (run ./dev.sh docs):\n{done.stderr[-3000:]}"


def test_every_verdict_word_is_inside_a_generated_block():
    """Outside the cog blocks the prose names no winner: the words of a verdict appear only in
    generated text (the (f, kappa) section, which is not from the store, aside)."""
    text = RESULTS.read_text(encoding="utf-8").split("## How robust is each rule")[0]
    prose = re.sub(r"<!-- \[\[\[cog.*?\[\[\[end\]\]\] -->", "", text, flags=re.S)
    words = re.compile(r"\b(better|worse|wrecked|degrades|robust to|beats|outperforms|tied for best|"
                       r"lower than|higher than)\b", re.I)
    assert [m.group(0) for m in words.finditer(prose)] == []


def test_a_files_tables_stand_on_its_own_seeds_not_a_search_trial_that_shares_a_cell():
    """A file's runs are matched at any seed: FBN's bucketing+cc tau-1 search tried min-max (unit)
    with honest statistics, one of the cc check's cells, on seed 10. The check's table and
    comparisons stand on seeds 0-4 only, and the tuning table on the tuning seeds."""
    sys.path.insert(0, str(ROOT / "docs"))
    import tables

    every = {r["seed"] for r in tables.file_runs(tables.CC_CHECK)}
    assert every - set(range(5)), "the shipped runs no longer hold the case this guards"
    assert {r["seed"] for r in tables.cc_check_runs()} == set(range(5))
    for agg in ("bucketing+cc", "cc"):
        for f in (2, 3):
            for attack in ("minmax", "alie", "ipm", "honest"):
                assert sorted(r["seed"] for r in tables.cc_check(agg, 1.0, f, attack)) == [0, 1, 2, 3, 4]
    assert {r["seed"] for r in tables.tuning_runs()} <= {10, 11}


def test_few_seeds_get_no_verdict():
    sys.path.insert(0, str(ROOT / "docs"))
    import tables
    from robustbn.stats import interval

    # an interval that excludes 0 on 4 pairs is still no verdict; on 5 it is one
    assert tables.verdict(interval([0.10, 0.11, 0.12, 0.10])) == "4 seeds, no verdict"
    assert tables.verdict(interval([0.10, 0.11, 0.12, 0.10, 0.11])) == "higher"
    assert tables.verdict(interval([-0.10, -0.11, -0.12, -0.10, -0.11])) == "lower"
    assert tables.verdict(interval([0.10, -0.11, 0.12, -0.10, 0.01])) == "tied"


def test_a_comparison_on_too_few_seeds_is_named_not_quoted(capsys):
    """A findings block quotes a comparison only on MIN_PAIRS paired seeds (3 where the block
    says so: the paper's schedule); the others are named, with their seed count, and no number."""
    sys.path.insert(0, str(ROOT / "docs"))
    import tables

    run = lambda seed, acc: {"seed": seed, "final_acc": acc, "status": "done"}
    five_a = [run(s, 0.70 + 0.01 * s) for s in range(5)]
    five_b = [run(s, 0.60 + 0.012 * s) for s in range(5)]

    @tables.findings
    def block():
        tables.compare("B on five seeds", five_b, five_a)
        tables.compare("B on two seeds", five_b[:2], five_a)
        tables.compare("B on three seeds, long schedule", five_b[:3], five_a, min_pairs=tables.LONG_MIN_PAIRS)

    block()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("- B on five seeds:") and "(5 pairs; lower)" in lines[0]
    assert lines[1].startswith("- B on three seeds, long schedule:") and "(3 pairs; lower)" in lines[1]
    assert lines[2].startswith("- Not quoted") and "B on two seeds (2 of 5 seeds run)" in lines[2]
    assert "60." not in lines[2] and "70." not in lines[2]
    block()  # the list of cut comparisons is the block's own: a second block starts empty
    assert capsys.readouterr().out.count("B on two seeds") == 1


def test_every_shipped_figure_carries_the_digest_results_md_prints_beside_it():
    """Each figure results.md draws from the runs (`![...](img/X.png) <!-- data D -->`) is the
    file docs/img/X.png whose PNG text chunk holds D: the text's check (`./dev.sh docs --check`)
    then vouches for the figure too, and a figure left stale by a run's change is caught."""
    from PIL import Image

    shown = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\) <!-- data ([0-9a-f]{16}) -->", RESULTS.read_text("utf-8"))
    assert len(shown) >= 5  # the two curves, the map, the two protocol figures
    for path, digest in shown:
        assert Image.open(ROOT / "docs" / path).text.get("robustbn-data") == digest, path


def test_the_picks_follow_the_generated_verdicts():
    """The picks above the leaderboard of docs/results.md say "use Y" only where Y's row is
    best in its protocol and threat model, and name every row tied for best."""
    text = RESULTS.read_text(encoding="utf-8")
    block = text[text.index("<!-- [[[cog tables.leaderboard() ]]] -->"):]
    block = block[:block.index("<!-- [[[end]]] -->")]
    picks = [line[2:] for line in block.splitlines() if line.startswith("- with ")]
    rows = [[c.strip().strip("*") for c in line.strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| protocol")]
    assert picks and rows
    for protocol, defense, server, *_, verdict in rows:
        model = "root-free" if server == "none (root-free)" else "trusted server data"
        (pick,) = [p for p in picks if p.startswith(f"with {protocol}, {model}")]
        if verdict == "best":
            assert f": use {defense} (" in pick
        elif verdict == "tied for best":
            assert "no single pick" in pick and f"{defense} (" in pick and ": use " not in pick
        else:
            assert f": use {defense} (" not in pick


def test_the_robustness_section_tabulates_the_curves_and_its_figure_carries_their_digest(tmp_path, monkeypatch,
                                                                                         capsys):
    """robustness_table: a row per defense, a cell per gamma with the worst case, its tuned lr and
    the clean accuracy, from the worst-case table; the figure it writes carries the digest its
    text prints, a changed number changes the digest (so `--check` fails), and in check mode
    no figure is drawn."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from PIL import Image
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.labels import compact_defense
    from robustbn.store import Store
    from robustbn.worst import worst_case

    store = Store(tmp_path / "c.sqlite")
    for seed in range(5):
        for d, defense in enumerate(DEFENSES):
            for gamma, lr in ((0.0, 0.1), (1.0, 0.01)):
                acc = 0.2 + 0.3 * d + 0.2 * gamma + 0.01 * seed
                add(store, acc, norm="fbn", f=3, gamma=gamma, lr=lr, seed=seed, **DEFENSES[defense],
                    **ATTACKS["sf-mean"])
                add(store, acc + 0.1, norm="fbn", f=3, gamma=gamma, lr=lr, seed=seed, **DEFENSES[defense])
    runs = store.rows()
    store.close()
    (tmp_path / "docs" / "img").mkdir(parents=True)
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    monkeypatch.setattr(tables, "tuning_status", lambda: "(status)")
    monkeypatch.delenv("ROBUSTBN_DOCS_CHECK", raising=False)
    (tmp_path / tables.ROBUSTNESS_MATRIX).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / tables.ROBUSTNESS_MATRIX).write_text('norm = ["fbn", "fixbn"]\n')  # FixBN planned, none finished
    tables.robustness_table("gamma")
    text = capsys.readouterr().out
    assert "Not here yet (tuning, or their tuned files' runs, not finished): FixBN." in text
    # the tuning plans a third FBN defense along gamma (f = 3) and one at f = 1 only: the first is named as not here
    from test_worst_case import ROBUST_DEFENSE
    planned = {("fbn", g, 3, None): {1: "mean", 2: ROBUST_DEFENSE, 3: "nnm+trmean"} for g in (0.0, 1.0)}
    planned[("fbn", 0.1, 1, None)] = {4: "dnc"}
    planned[("fbn", 0.5, 3, None)] = {2: ROBUST_DEFENSE}  # a point of a drawn defense not finished: named with it
    real = tables.tuning_file, tables.planned_defenses
    monkeypatch.setattr(tables, "tuning_file", lambda: tables.ROBUSTNESS_MATRIX)  # a file that is there
    monkeypatch.setattr(tables, "planned_defenses", lambda: planned)
    tables.robustness_table("gamma")
    assert ("not finished): FBN's mean (grad), nnm+median (BN) at gamma = 0.5 and nnm+trmean; FixBN."
            in capsys.readouterr().out)
    monkeypatch.setattr(tables, "tuning_file", real[0])
    monkeypatch.setattr(tables, "planned_defenses", real[1])
    truth = {(t["defense"], t["gamma"]): t for t in worst_case(runs, ("lr",))}
    for (defense, gamma), t in truth.items():  # a row per defense and gamma, the defense in short words
        row = next(line for line in text.splitlines() if line.startswith(f"| {compact_defense(defense)} | {gamma:g} |"))
        _, _, worst, searched, lr, clean = row.strip("| ").split(" | ")
        assert worst.startswith(f"{100 * t['worst_acc']:.1f} [") and worst.endswith("(5 seeds)")
        assert (searched, lr) == ("", f"{t['lr']:g}") and clean.startswith(f"{100 * t['no_attack_acc']:.1f} [")
    digest = re.search(r"<!-- data ([0-9a-f]{16}) -->", text).group(1)
    tables.robustness_map()  # the map: at each gamma the higher defense, paired over 5 seeds, at its lr
    best = {g: max((t for t in truth.values() if t["gamma"] == g), key=lambda t: t["worst_acc"]) for g in (0.0, 1.0)}
    out = capsys.readouterr().out.splitlines()
    for g in (0.0, 1.0):  # a row per pick, the defense in short words
        row = next(line for line in out if line.startswith(f"| {g:g}, 3 |"))
        assert row == (f"| {g:g}, 3 | use | {compact_defense(best[g]['defense'])}: "
                       f"{tables.estimate_cell(best[g])[:-1]}; lr {best[g]['lr']:g}) |")
    assert "52.0 [50.0, 54.0] (5 seeds; lr 0.1)" in "\n".join(out)  # the interval and seeds of each pick
    # under each lone pick, the other defense, lower by the paired gap
    assert sum(line.startswith("|  | next, lower by 30.0 [30.0, 30.0] (5 pairs) | ") for line in out) == 2
    image = tmp_path / "docs" / "img" / "robustness_gamma.png"
    assert Image.open(image).text["robustbn-data"] == digest

    image.unlink()
    monkeypatch.setenv("ROBUSTBN_DOCS_CHECK", "1")
    runs[0] = {**runs[0], "final_acc": runs[0]["final_acc"] - 0.05,
               "history": [{**h, "test_acc": h["test_acc"] - 0.05} for h in runs[0]["history"]]}
    tables.robustness_table("gamma")
    again = capsys.readouterr().out
    assert not image.exists()
    assert re.search(r"<!-- data ([0-9a-f]{16}) -->", again).group(1) != digest


def test_curve_searches_list_each_pick_until_its_confirmation_is_counted(tmp_path, monkeypatch, capsys):
    """curve_searches: at a point where two defenses ran and the pick stands above chance, the
    pick (not the other defense) gets a search on its tuned file (--on) with a confirmation
    file; a point whose pick is at chance gets none; once the confirmation's runs are among the
    curves' runs, the pick reads as searched and its command is gone."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, BASE, DEFENSES, add

    from robustbn.evaluate import toml_text
    from robustbn.store import Store, scenario_dict

    tuned_dir = tmp_path / tables.TUNED_DIR
    tuned_dir.mkdir(parents=True)
    store = Store(tmp_path / "c.sqlite")
    for gamma, lr, level in ((0.0, 0.1, 0.1), (1.0, 0.01, 0.5)):  # at gamma 0 both defenses are at chance
        for d, defense in enumerate(DEFENSES):
            values = {**BASE, "norm": "fbn", "f": 3, "gamma": gamma, "lr": lr, "seed": list(range(5)),
                      **DEFENSES[defense]}
            name = f"tuned_fbn_{defense.replace('+', '_')}_gamma_{gamma:g}.toml"
            (tuned_dir / name).write_text(toml_text(values))
            for seed in range(5):
                acc = level + (0.3 * d + 0.01 * seed) * (gamma > 0)
                add(store, acc, norm="fbn", f=3, gamma=gamma, lr=lr, seed=seed, **DEFENSES[defense],
                    **ATTACKS["sf-mean"])
    runs = store.rows()
    store.close()
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    monkeypatch.setattr(tables, "_search_space", lambda norm, defense: f"scenarios/search_{norm}.toml")
    tables.curve_searches()
    out = capsys.readouterr().out
    assert "Of these 1, 0 are fully searched" in out
    (command,) = [line for line in out.splitlines() if line.startswith("robustbn attack-search")]
    confirm = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_gamma_1.toml"
    assert f"--on {tables.TUNED_DIR}/tuned_fbn_nnm_median_gamma_1.toml" in command and f"--confirm {confirm}" in command
    assert "| FBN | root-free | 1 | 3 | mean (grad), nnm+median (BN) (lr 0.01) | 82.0" in out and "| not yet |" in out
    assert "--try" not in command
    # attacks confirmed against the same defense at an lr its point no longer runs are tried too (--try): at
    # another point, and at this one before its search rewrites that file; one file per attack
    stale = {"description": "The worst attack that robustbn attack-search found", **BASE, "norm": "fbn", "f": 3,
             "lr": 0.05, "seed": list(range(5)), **DEFENSES["nnm+median"], "grad_attack": "alie"}
    elsewhere = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_gamma_0.toml"
    twin = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_gamma_0_earlier_1.toml"  # the same attack again
    for path, gamma in ((elsewhere, 0.0), (twin, 0.0), (confirm, 1.0)):
        (tmp_path / path).write_text(toml_text({**stale, "gamma": gamma}))
    real = tables.all_finished
    monkeypatch.setattr(tables, "all_finished", lambda path: path in (elsewhere, twin) or real(path))
    (command,) = tables.curve_search_rows()[1]
    assert command.count("--try") == 1 and f"--try {elsewhere}" in command  # one per attack
    other = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_gamma_0_earlier_2.toml"
    (tmp_path / other).write_text(toml_text({**stale, "gamma": 0.0, "grad_attack": "ipm"}))
    monkeypatch.setattr(tables, "all_finished", lambda path: path in (elsewhere, twin, other) or real(path))
    (command,) = tables.curve_search_rows()[1]
    assert f"--try {elsewhere}" in command and f"--try {other}" in command and command.count("--try") == 2
    monkeypatch.setattr(tables, "all_finished", lambda path: path == confirm or real(path))  # its own, stale
    for path in (elsewhere, twin, other):
        (tmp_path / path).unlink()
    (command,) = tables.curve_search_rows()[1]
    assert f"--try {confirm}" in command and f"--confirm {confirm}" in command
    (tmp_path / confirm).unlink()
    monkeypatch.setattr(tables, "all_finished", real)
    tables._planned_scenarios.cache_clear()  # the files above are gone or rewritten below: not their runs
    tables.robustness_map()  # the map says which picks stand on the catalogue's attacks only
    out = capsys.readouterr().out
    assert re.search(r"\| mean \(grad\), nnm\+median \(BN\): 82\.0 \[[\d.]+, [\d.]+\] \(5 seeds; lr 0\.01, "
                     r"not searched yet\) \|", out)
    assert 'A pick "not searched yet" stands on the catalogue\'s attacks only' in out
    tuned_text = (tuned_dir / "tuned_fbn_nnm_median_gamma_1.toml").read_text()
    (tmp_path / confirm).write_text(tuned_text)  # a confirmation runs at its point's tuned lr
    searched = [{**r, "source": confirm} if r["gamma"] == 1.0 and r["bn_agg"] == "nnm+median" else r for r in runs]
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: searched)
    mine = [r for r in searched if r.get("source") == confirm]
    monkeypatch.setattr(tables, "planned_scenarios", lambda path: tuple(scenario_dict(r) for r in mine))
    monkeypatch.setattr(tables, "own_seed_runs", lambda path: mine[:-1])  # 4 of its 5 runs finished: not yet
    tables.curve_searches()
    assert "Of these 1, 0 are fully searched and confirmed, 0 have their own" in capsys.readouterr().out
    monkeypatch.setattr(tables, "own_seed_runs", lambda path: mine)
    tables.curve_searches()
    out = capsys.readouterr().out
    assert "Of these 1, 1 are fully searched" in out and "robustbn attack-search" not in out
    tables.robustness_map()
    out = capsys.readouterr().out
    assert re.search(r"82\.0 \[[\d.]+, [\d.]+\] \(5 seeds; lr 0\.01, searched\)", out) and "not searched yet)" not in out
    # once the point's choice moves (a wider grid), the confirmation at the old lr is another setting: not read,
    # and the pick is searched again
    (tmp_path / confirm).write_text(tuned_text.replace("lr = 0.01", "lr = 0.005"))
    tables.curve_searches()
    assert "Of these 1, 0 are fully searched" in capsys.readouterr().out
    assert confirm not in tables.current_confirmations() and confirm in tables.curve_confirmations()
    (tmp_path / confirm).write_text(tuned_text)
    # the same runs made on a GPU (their hashes are the GPU's) finish the confirmation too
    from robustbn.store import scenario_hash
    monkeypatch.setattr(tables, "own_seed_runs",
                        lambda path: [{**r, "hash": scenario_hash({**scenario_dict(r), "device": "cuda"})} for r in mine])
    tables.curve_searches()
    assert "Of these 1, 1 are fully searched" in capsys.readouterr().out
    # a point where fewer defenses ran than the tuning plans: no pick in the map, no search
    monkeypatch.setattr(tables, "expected_defenses", lambda norm, threat, gamma, f: 3)
    tables.robustness_map()
    assert "| 1, 3 | 2 of 3 defenses run, no pick yet | " in capsys.readouterr().out
    tables.curve_searches()
    assert "There is none now." in capsys.readouterr().out


def test_the_protocol_map_pairs_each_protocols_top_defense_by_seed(tmp_path, monkeypatch, capsys):
    """protocol_map: at each point each protocol stands at its highest defense there; the
    protocols are compared by the paired rule (naive BN above FBN at gamma 0, where it wins on
    every seed; tied at gamma 1, where the seeds disagree), a planned protocol with no run is
    named as not yet finished, and one protocol alone reads "only ... finished"; then each defense
    under both protocols, paired against FBN."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.store import Store

    noise = [0.00, 0.03, -0.02, 0.01, -0.01]
    store = Store(tmp_path / "p.sqlite")
    for seed in range(5):
        for gamma in (0.0, 1.0):
            for norm in ("naive", "fbn"):
                for d, defense in enumerate(DEFENSES):
                    if gamma == 0.0:  # naive's best 0.6 + noise, FBN's best 0.4 + noise: naive higher on every seed
                        acc = (0.6 if norm == "naive" else 0.4) - 0.2 * (d == 0) + noise[seed]
                    else:  # the seeds disagree: FBN above on some, below on others
                        acc = 0.5 + (noise[seed] if norm == "fbn" else noise[(seed + 2) % 5]) - 0.2 * (d == 0)
                    add(store, acc, norm=norm, f=3, gamma=gamma, lr=0.05, seed=seed, **DEFENSES[defense],
                        **ATTACKS["sf-mean"])
        add(store, 0.3 + noise[seed], norm="fbn", f=1, gamma=0.1, lr=0.05, seed=seed, **ATTACKS["sf-mean"])
        add(store, 0.1, norm="fbn", f=2, gamma=0.1, lr=0.05, seed=seed, **ATTACKS["sf-mean"])
    runs = store.rows()
    store.close()
    (tmp_path / tables.TUNED_DIR).mkdir(parents=True)
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    (tmp_path / tables.ROBUSTNESS_MATRIX).write_text('norm = ["fbn", "naive", "fixbn"]\n')
    tables.protocol_map()
    out = capsys.readouterr().out.splitlines()
    robust = "mean (grad), nnm+median (BN)"
    at = lambda head: out.index(next(line for line in out if line.startswith(head)))
    i = at("| 0, 3 |")
    # no search confirmed here: the leader holds the verdict back (FBN, lower, would not turn it)
    assert out[i].startswith("| 0, 3 | naive BN above (of those finished; FixBN not yet); provisional: no attack "
                             f"search confirmed against naive BN | naive BN ({robust}): 60.2 [")
    provisional = "; provisional: no attack search confirmed against naive BN, FBN"  # tied: both decide
    assert out[i + 1].startswith(f"|  | lower by 20.0 [20.0, 20.0] (5 pairs) | FBN ({robust}): 40.2 [")
    j = at("| 1, 3 |")
    assert out[j].startswith(f"| 1, 3 | 2 tied (of those finished; FixBN not yet){provisional} | ")
    assert out[j + 1].startswith(f"|  | tied, gap 0.0 [-3.2, 3.2] (5 pairs) | FBN ({robust}): 50.2 [")
    assert next(line for line in out if line.startswith("| 0.1, 1 |")).startswith(
        "| 0.1, 1 | only FBN finished (naive BN, FixBN not yet) | FBN (mean): 30.2 [")
    assert next(line for line in out if line.startswith("| 0.1, 2 |")).startswith(
        "| 0.1, 2 | only FBN finished, at chance (naive BN, FixBN not yet) | FBN (mean): 10.0 [")
    # the same defense under both protocols, no choice made: naive BN - FBN, paired, at (0, 3) the undefended mean
    assert next(line for line in out if line.startswith("| mean | 0, 3 |")).endswith(
        "| naive BN: 40.2 [37.8, 42.6] (5 seeds), +20.0 [20.0, 20.0] (5 pairs; higher) |")


def test_protocol_tables_give_no_verdict_below_five_pairs(tmp_path, capsys):
    """protocol_tables on two seeds: the cell says "2 seeds, no verdict" and its rows give the
    paired gap alone, never "lower by" (the pages give no verdict on fewer than 5 pairs), and no
    "provisional" where there is no verdict to hold back."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.store import Store
    from robustbn.worst import protocol_map

    with Store(tmp_path / "b.sqlite") as store:
        for seed in range(2):
            for norm, level in (("naive", 0.3), ("fbn", 0.6)):
                add(store, level + 0.01 * seed, norm=norm, f=3, gamma=0.0, seed=seed, **DEFENSES["mean"],
                    **ATTACKS["sf-mean"])
        runs = store.rows()
    tables.protocol_tables(protocol_map(runs), 0.1, {False: ["fbn", "naive"], True: []}, lambda c, t: "",
                           lambda c, t: False)
    out = capsys.readouterr().out
    assert "| 0, 3 | 2 seeds, no verdict | FBN (mean): 60.5 [" in out
    assert "|  | gap 30.0 [30.0, 30.0] (2 pairs) | naive BN (mean): 30.5 [" in out
    assert "lower by" not in out and "provisional" not in out


def test_grid_edge_counts_the_choices_at_either_end_of_the_grid(capsys):
    """grid_edge: choices at the grid's lowest and highest lr counted, those at chance among
    them, and per protocol how many sit at an edge."""
    sys.path.insert(0, str(ROOT / "docs"))
    import tables

    choice = lambda norm, lr, acc, defense="fltrust on the gradients": {
        "norm": norm, "chosen": {"lr": lr}, "chosen_acc": acc, "defense": defense}
    tables.grid_edge([0.01, 0.05, 0.1], [choice("fbn", 0.01, 0.1, "mean"), choice("fbn", 0.05, 0.6),
                                         choice("fbn", 0.1, 0.7), choice("naive", 0.1, 0.5)])
    out = capsys.readouterr().out
    assert ("of the 4 choices settled, 1 at lr 0.01 (its lowest; mean 1) and 2 at lr 0.1 (its highest; "
            "fltrust (grad) 2); 1 of those at chance") in out
    assert "Per protocol, at an edge: FBN 2 of 3, naive BN 1 of 1." in out


def test_curve_searches_pass_over_a_tied_pick_at_chance(tmp_path, monkeypatch, capsys):
    """Two defenses tied for best (paired over 5 seeds), one of them at chance: only the other
    is searched (a search cannot lower a defense at chance)."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, BASE, DEFENSES, add

    from robustbn.evaluate import toml_text
    from robustbn.store import Store, scenario_dict
    from robustbn.worst import TIED

    tuned_dir = tmp_path / tables.TUNED_DIR
    tuned_dir.mkdir(parents=True)
    store = Store(tmp_path / "c.sqlite")
    for d, defense in enumerate(DEFENSES):
        values = {**BASE, "norm": "fbn", "f": 3, "gamma": 0.5, "lr": 0.1, "seed": list(range(5)), **DEFENSES[defense]}
        (tuned_dir / f"tuned_fbn_{defense.replace('+', '_')}.toml").write_text(toml_text(values))
        for seed in range(5):  # the mean at chance; nnm+median 3.8 points above it, tied (t = 1.9)
            acc = 0.1 if d == 0 else 0.13 + 0.04 * (-1) ** seed
            add(store, acc, norm="fbn", f=3, gamma=0.5, lr=0.1, seed=seed, **DEFENSES[defense], **ATTACKS["sf-mean"])
    runs = store.rows()
    store.close()
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    monkeypatch.setattr(tables, "_search_space", lambda norm, defense: f"scenarios/search_{norm}.toml")
    from robustbn.worst import defense_map

    (cell,) = defense_map(runs, "gamma", "f", tables.TUNED, tables.expected_defenses)
    assert cell["verdict"] == TIED and len(cell["picks"]) == 2
    tables.curve_searches()
    out = capsys.readouterr().out
    assert "Of these 1, 0 are fully searched" in out
    (command,) = [line for line in out.splitlines() if line.startswith("robustbn attack-search")]
    assert f"--on {tables.TUNED_DIR}/tuned_fbn_nnm_median.toml" in command
    # a pick that its own confirmed search brought to chance stays listed, as searched
    confirm = f"{tables.TUNED_DIR}/searched_worst_fbn_mean.toml"
    (tmp_path / confirm).write_text((tuned_dir / "tuned_fbn_mean.toml").read_text())
    searched = [{**r, "source": confirm} if r["bn_agg"] == "mean" else r for r in runs]
    mine = [r for r in searched if r.get("source") == confirm]
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: searched)
    monkeypatch.setattr(tables, "planned_scenarios", lambda path: tuple(scenario_dict(r) for r in mine))
    monkeypatch.setattr(tables, "own_seed_runs", lambda path: mine)
    tables.curve_searches()
    out = capsys.readouterr().out
    assert "Of these 2, 1 are fully searched" in out
    assert "| FBN | root-free | 0.5 | 3 | mean (lr 0.1) | 10.0 [10.0, 10.0] (5 seeds) | the map | yes |" in out
    # nnm+median's search then tries the mean's found attack too... only where it is the same defense:
    # a confirmed search of another defense is no --try of this one
    (command,) = [line for line in out.splitlines() if line.startswith("robustbn attack-search")]
    assert "--try" not in command


def test_a_search_tries_the_attacks_confirmed_at_the_same_defenses_other_points(tmp_path, monkeypatch, capsys):
    """nnm+median is a pick at gamma 0.5 and at gamma 1; once its search at gamma 1 is confirmed,
    the search at gamma 0.5 is left until it has tried that attack (`--try`, named with its attack
    in the confirmation's description), and the one at gamma 1 until it has tried gamma 0.5's."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, BASE, DEFENSES, add

    from robustbn.evaluate import toml_text
    from robustbn.store import Store, scenario_dict

    tuned_dir = tmp_path / tables.TUNED_DIR
    tuned_dir.mkdir(parents=True)
    store = Store(tmp_path / "c.sqlite")
    for gamma in (0.5, 1.0):
        for d, defense in enumerate(DEFENSES):
            values = {**BASE, "norm": "fbn", "f": 3, "gamma": gamma, "lr": 0.1, "seed": list(range(5)),
                      **DEFENSES[defense]}
            (tuned_dir / f"tuned_fbn_{defense.replace('+', '_')}_{gamma:g}.toml").write_text(toml_text(values))
            for seed in range(5):  # both above chance, tied
                acc = 0.3 + 0.02 * d + 0.04 * (-1) ** seed
                add(store, acc, norm="fbn", f=3, gamma=gamma, lr=0.1, seed=seed, **DEFENSES[defense],
                    **ATTACKS["sf-mean"])
    runs = store.rows()
    store.close()
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    monkeypatch.setattr(tables, "_search_space", lambda norm, defense: f"scenarios/search_{norm}.toml")
    at_1 = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_1.toml"
    at_half = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_0.5.toml"
    values = {**BASE, "norm": "fbn", "f": 3, "gamma": 1.0, "lr": 0.1, "seed": list(range(5)),
              **DEFENSES["nnm+median"], **ATTACKS["sf-mean"]}
    (tmp_path / at_1).write_text(toml_text({**values, "description": "found at gamma 1"}))
    mine = lambda path: [r for r in runs if r["gamma"] == (1.0 if path == at_1 else 0.5)
                         and r["bn_agg"] == DEFENSES["nnm+median"]["bn_agg"]]
    monkeypatch.setattr(tables, "planned_scenarios", lambda path: tuple(scenario_dict(r) for r in mine(path)))
    monkeypatch.setattr(tables, "own_seed_runs", mine)
    found, attack_of = {at_half: "ALIE on the gradients + SF on the mean"}, tables.attack_of
    monkeypatch.setattr(tables, "attack_of", lambda path: found.get(path) or attack_of(path))  # another attack there

    outs = []

    def left():
        tables.curve_searches()
        outs.append(capsys.readouterr().out)
        return {line.split(" --on ")[1].split()[0]: line for line in outs[-1].splitlines()
                if line.startswith("robustbn attack-search")}
    commands = left()
    at_half_tuned = f"{tables.TUNED_DIR}/tuned_fbn_nnm_median_0.5.toml"
    assert f"--try {at_1} " in commands[at_half_tuned]
    # gamma 1's own search is confirmed but has nothing to try yet (gamma 0.5 has no confirmation)
    assert not any("_nnm_median_1.toml" in k for k in commands)
    words = "SF on the mean"
    (tmp_path / at_half).write_text(toml_text({**values, "gamma": 0.5, "description":
                                               f"found at gamma 0.5; it tried too {Path(at_1).name} ({words})"}))
    commands = left()
    assert at_half_tuned not in commands  # tried gamma 1's attack: done
    assert f"--try {at_half} " in commands[f"{tables.TUNED_DIR}/tuned_fbn_nnm_median_1.toml"]
    assert ("Of these 2, 1 are fully searched and confirmed, 1 have their own search confirmed but not yet the "
            "attacks confirmed against the same defense at its other points, and 0 are not searched yet.") in outs[-1]
    # had gamma 0.5's search confirmed gamma 1's own attack, there would be nothing new to try at gamma 1
    found.clear()
    assert left() == {}
    # an attack kept at gamma 1 (a sampler's find a --try beat) is untried there: the search runs again, and it
    # is given its own confirmed attack too (gamma 0.5's file holds it): without it, it would confirm the kept
    # one, and the next listing would flip it back, each time keeping another _earlier_ file
    kept = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_1_earlier_1.toml"
    (tmp_path / kept).write_text(toml_text({**values, "description": "kept"}))
    found[kept] = "IPM on the gradients"
    command = left()[f"{tables.TUNED_DIR}/tuned_fbn_nnm_median_1.toml"]
    assert f"--try {at_half} " in command and f"--try {kept} " in command and f"--try {at_1} " not in command
    # where no other file holds gamma 1's own attack any more, its own file is the --try (read before rewritten)
    found[at_half] = "ALIE on the gradients + SF on the mean"
    assert f"--try {at_1} " in left()[f"{tables.TUNED_DIR}/tuned_fbn_nnm_median_1.toml"]


@pytest.mark.parametrize("board_acc, near, spread", [(0.15, True, 0.002), (0.45, False, 0.002), (0.07, True, 0.04)])
def test_the_f_sweeps_level_is_argued_from_the_board_and_the_curves(tmp_path, monkeypatch, capsys, board_acc, near,
                                                                    spread):
    """f_sweep_level: per protocol, the highest root-free worst case on the board (gamma = 0)
    and on the curves at gamma 0 and 0.1; the sentence names a protocol within 10 points of
    chance on the board, and only then, and says where its interval holds chance."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.store import Store

    store = Store(tmp_path / "c.sqlite")
    board, curve = [], []
    for seed in range(5):
        for d, defense in enumerate(DEFENSES):
            acc = board_acc - 0.05 * d + spread * seed  # the mean (d = 0) is the higher
            board += [add(store, acc, norm="fbn", f=3, gamma=0.0, lr=0.05, seed=seed, **DEFENSES[defense],
                          **ATTACKS["sf-mean"])]
            for gamma, lr in ((0.0, 0.1), (0.1, 0.01)):
                curve += [add(store, acc + 0.1 + gamma, norm="fbn", f=3, gamma=gamma, lr=lr, seed=seed,
                              **DEFENSES[defense], **ATTACKS["sf-mean"])]
    runs = store.rows()
    store.close()
    monkeypatch.setattr(tables, "board_runs", lambda: [r for r in runs if r["hash"] in board])
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: [r for r in runs if r["hash"] in curve])
    monkeypatch.setattr(tables, "expected_defenses", lambda norm, threat, gamma, f: 2)  # both ran everywhere
    tables.f_sweep_level()
    text = capsys.readouterr().out
    (fbn,) = [line for line in text.splitlines() if line.startswith("| FBN |")]
    cells = fbn.split(" | ")[1:]
    top = board_acc + 2 * spread  # the mean over seeds 0-4
    assert cells[0].startswith(f"{100 * top:.1f} [") and "(5 seeds), mean" in cells[0]
    assert cells[1].startswith(f"{100 * (top + 0.1):.1f} [") and cells[1].endswith("lr 0.1")
    assert cells[2].startswith(f"{100 * (top + 0.2):.1f} [") and cells[2].endswith("lr 0.01 |")
    assert "| naive BN | - | - | - |" in text
    assert (f"FBN's best stands {100 * (top - 0.1):.1f} points above chance" in text) == near
    assert ("No protocol's best root-free row" in text) == (not near)
    # seeds spread wide: the board's 5-point room is no room at all, its interval holding chance
    assert ("points above chance (its interval holding chance)" in text) == (spread > 0.01)
    # tuned, the curves at gamma 0 stand 10 points above the board: more room than the board promised, said
    assert (f"gamma = 0 has more room than that: FBN's best stands at {100 * (top + 0.1):.1f}. For FBN the premise "
            f"held at the board's lr 0.05, not at the tuned ones" in text) == near
    # a point where a planned defense has not finished names no highest: the rest may stand above it
    monkeypatch.setattr(tables, "expected_defenses", lambda norm, threat, gamma, f: 3)
    tables.f_sweep_level()
    (fbn,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| FBN |")]
    assert fbn.split(" | ")[2:] == ["2 of 3 finished", "2 of 3 finished |"]


def test_where_the_f_curves_stand_above_chance_is_said_per_protocol(tmp_path, monkeypatch, capsys):
    """f_sweep_level's measured sentence: with two protocols near chance at gamma = 0.1, f = 3, each
    protocol's f values where its map pick stands above chance are its own (FBN's at f = 1, naive
    BN's at none), not the union over protocols."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.store import Store

    level = {("fbn", 1): (0.5, 0.3), ("fbn", 3): (0.103, 0.101), ("naive", 1): (0.1, 0.1), ("naive", 3): (0.102, 0.1)}
    zero = {"fbn": (0.106, 0.1), "naive": (0.1, 0.1)}  # gamma = 0, f = 3: near chance as well
    on_board = {"fbn": (0.12, 0.1), "naive": (0.3, 0.1)}  # naive BN had room on the board, FBN none
    board = []
    with Store(tmp_path / "c.sqlite") as store:
        points = [(norm, f, 0.1, accs) for (norm, f), accs in level.items()]
        for norm, f, gamma, accs in points + [(norm, 3, 0.0, accs) for norm, accs in zero.items()]:
            for seed in range(5):
                for d, (acc, defense) in enumerate(zip(accs, DEFENSES)):
                    add(store, acc + 0.001 * seed * (acc > 0.2), norm=norm, f=f, gamma=gamma, lr=0.01, seed=seed,
                        **DEFENSES[defense], **ATTACKS["sf-mean"])
                    if gamma == 0.0:
                        board.append(add(store, on_board[norm][d] + 0.001 * seed, norm=norm, f=3, gamma=0.0,
                                         lr=0.05, seed=seed, **DEFENSES[defense], **ATTACKS["sf-mean"]))
        runs = store.rows()
    monkeypatch.setattr(tables, "board_runs", lambda: [r for r in runs if r["hash"] in board])
    curve = [r for r in runs if r["hash"] not in board]
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: [r for r in curve if r["f"] == 3] if x == "gamma" else
                        [r for r in curve if r["gamma"] == 0.1])
    monkeypatch.setattr(tables, "expected_defenses", lambda norm, threat, gamma, f: 2)
    tables.f_sweep_level()
    text = capsys.readouterr().out
    assert ("at gamma = 0.1, f = 3, FBN's best stands 0.3 points above chance and naive BN's best stands 0.2 points "
            "above chance" in text)
    assert "Along f, the map's root-free pick stands above chance: FBN's at f = 1 only, naive BN's at no f." in text
    # the level was argued from FBN's board row alone: naive BN's room there is said, not passed over
    assert ("FBN's best stands 2.2 points above chance: a sweep of f there would have almost no room to fall (the "
            "level was not chosen for naive BN's 20.2 points above chance), so the f sweep holds gamma = 0.1") in text
    # gamma = 0 is near chance on the curves too: the level did not lose the board's room (naive BN's; FBN had none)
    assert ("At gamma = 0 the curves stand within 10 points of chance too, where the board (lr 0.05) stands higher "
            "(naive BN 10.0 against the board's 30.2): that room is on neither level of the curves, so it was not "
            "the level that lost it.") in text


def test_a_curve_searchs_trials_count_with_the_curves_not_the_board():
    """The time table counts a curve search's trial runs (seeds 10, 11, at a tuned point's setting)
    with the curves: the trial its confirmation repeats on seeds 0-4 is one of them."""
    sys.path.insert(0, str(ROOT / "docs"))
    import tables
    from robustbn.worst import NOT_SETTING

    confirmed = [r for f in tables.curve_confirmations() for r in tables.own_seed_runs(f)]
    assert confirmed, "the shipped runs no longer hold a confirmed curve search"
    keep = set(NOT_SETTING) - {"seed"}
    same = {tuple(sorted((k, str(v)) for k, v in r.items() if k not in keep and k != "seed")) for r in confirmed}
    trials = [r for r in tables.rows() if r["seed"] in (10, 11)
              and tuple(sorted((k, str(v)) for k, v in r.items() if k not in keep and k != "seed")) in same]
    assert trials and all(r["hash"] in tables.curve_hashes() for r in trials)
    # the board's own search of FBN's nnm+trmean (gamma = 0, f = 3, lr 0.05): at a point the curves
    # tuned to lr 0.01, its trials outside the tuning's attacks are the board's
    tuning = {r["hash"] for r in tables.tuning_runs()}
    board = [r for r in tables.rows() if r["seed"] in (10, 11) and r["norm"] == "fbn" and r["gamma"] == 0.0
             and r["f"] == 3 and r["lr"] == 0.05 and r["grad_agg"] == "nnm+trmean" and r["hash"] not in tuning]
    assert board and not any(r["hash"] in tables.curve_hashes() for r in board)


def test_the_curve_cost_table_splits_each_curves_runs_once(capsys):
    """Per protocol and curve, tuning + reported + trials = the CPU's runs + the GPU's = the
    finished curve runs on that sweep, and no curve has more whole points than planned."""
    sys.path.insert(0, str(ROOT / "docs"))
    import tables
    from robustbn.labels import norm_words

    tables.curve_cost_table()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert lines
    curve = [r for r in tables.rows() if r["hash"] in tables.curve_hashes()]
    for line in lines:
        norm, along, points, tuning, reported, trials, cpu, gpu = [c.strip() for c in line.strip("|").split("|")]
        done, planned = map(int, points.split(" of "))
        held, value = tables.SWEEPS[along.split()[0]]
        mine = [r for r in curve if float(r[held]) == value and norm_words(r["norm"]) == norm]
        count = int(tuning) + int(reported) + int(trials)
        assert count == int(cpu.split("(")[1][:-1]) + int(gpu.split("(")[1][:-1]) == len(mine)
        assert 0 <= done <= planned and planned > 0


def test_tuning_moved_reads_the_tuning_runs_of_every_device(capsys):
    """A tuning run finished on a GPU hashes apart from the CPU's (the device is in the hash) and
    is the same run to `robustbn tune`: it is among the runs the choices read, under the plan's
    hash. Each point whose defenses all have a tuned file at their settled choice (tune writes it
    once the choice settles; a moved choice's file at its next wave) is a row of the table, at
    the files' lr."""
    sys.path.insert(0, str(ROOT / "docs"))
    import tables
    from robustbn.labels import norm_words

    assert any(str(r.get("device")).startswith("cuda") for r in tables.tuning_runs()), \
        "the shipped runs no longer hold a tuning run on a GPU"
    finished, choices = tables.tuning_choices()
    assert any(str(r.get("device")).startswith("cuda") for r in finished.values())
    settled = {(c["norm"], c["defense"], c["setting"]["gamma"], c["setting"]["f"]): c["chosen"]["lr"]
               for c in choices if c["complete"]}
    # a tuned file's point is spelled as the tuning's choices spell it (unsettled_points and the lanes match them)
    assert set(tables.tuned_points()) <= {(c["norm"], c["defense"], c["setting"]["gamma"], c["setting"]["f"])
                                          for c in choices}
    files = defaultdict(list)
    for f in tables.tuned_files():
        point, lr = tables.point_of_file(f)
        if settled.get(point) == lr:
            first = tables.own_seed_runs(f) or [tables.planned_scenarios(f)[0]]
            files[tables.curve_cell(first[0])].append(lr)
    whole = {cell: lrs for cell, lrs in files.items() if len(lrs) == len(tables.planned_defenses()[cell])}
    assert whole, "no point of the shipped runs has every defense tuned and written"
    tables.tuning_moved()
    out = capsys.readouterr().out
    # a choice may settle in the runs exported before tune's next wave writes its file: at least
    tuned = int(re.search(r"\((\d+) of %d so far\)" % len(tables.planned_defenses()), out).group(1))
    assert tuned >= len(whole)
    for (norm, gamma, f, data), lrs in whole.items():
        row = next(line for line in out.splitlines() if line.startswith(f"| {norm_words(norm)} | {gamma:g} | {f} | "
                                                                         f"{'root-free' if data is None else 'trusted'} |"))
        assert sorted(float(x) for x in re.findall(r"\blr ([0-9.]*[0-9])", row.split(" | ")[-1])) == sorted(lrs)
        # each gain carries its seeds: a paired interval over the tuning seeds, or a bound's seeds
        for gain in row.split(" | ")[-1].split("; lr")[:-1]:
            assert re.search(r"\((2 pairs|2 seeds, a bound)$", gain) or "the matrix's" in gain, gain


def test_a_tuning_gain_is_paired_over_the_tuning_seeds_or_a_bound():
    """tuning_moved's gain per defense: the tuned lr's worst case - the matrix's, paired over the
    tuning seeds (the interval a paired t gives on 2 pairs, clipped to +-100 points); a bound,
    with no interval, where the matrix's lr was pruned; no difference where it was kept."""
    sys.path.insert(0, str(ROOT / "docs"))
    import tables
    from robustbn.stats import paired

    base = {"point": {"lr": 0.05}, "worst_acc": 0.40, "seeds": 2, "pruned": False, "worst_by_seed": {10: 0.38, 11: 0.42}}
    tuned = {"point": {"lr": 0.1}, "worst_acc": 0.47, "seeds": 2, "pruned": False, "worst_by_seed": {10: 0.44, 11: 0.50}}
    d = paired(base["worst_by_seed"], tuned["worst_by_seed"])
    assert tables._tuning_gain(tuned, base) == f"+7.0 [{100 * d.low:.1f}, {100 * d.high:.1f}] (2 pairs; lr 0.1)"
    assert d.low < 0 < d.high  # two seeds: wide, and no verdict claimed
    wild = {**tuned, "worst_acc": 0.65, "worst_by_seed": {10: 0.40, 11: 0.90}}  # t on 1 df: past +-100 points
    assert tables._tuning_gain(wild, base) == "+25.0 [-100.0, 100.0] (2 pairs; lr 0.1)"
    assert tables._tuning_gain(tuned, {**base, "pruned": True}) == "at least +7.0 (2 seeds, a bound; lr 0.1)"
    assert tables._tuning_gain(base, base) == "+0.0 (lr 0.05, the matrix's)"


def test_curve_findings_pair_each_sweeps_ends_and_the_trusted_defense_against_the_root_free_pick(
        tmp_path, monkeypatch, capsys):
    """curve_findings: per defense, the far end of the f sweep against the near end, paired over
    seeds ("lower" where every seed fell; "both at or below chance" for a defense at chance at both
    ends, whatever tiny difference its seeds have); per point, the trusted defense against the
    highest root-free one, with the pick's search mark."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.labels import compact_defense
    from robustbn.store import Store
    from robustbn.worst import worst_case

    trusted = dict(grad_agg="fltrust", bn_agg="nnm+median")
    level = {  # (defense, f) -> seed 0's accuracy under the one attack; each seed adds 0.01 (chance: 0.1 - 0.001 s)
        ("mean", 1): 0.1, ("mean", 4): 0.1, ("nnm+median", 1): 0.7, ("nnm+median", 4): 0.3,
        ("fltrust", 1): 0.6, ("fltrust", 4): 0.55}
    store = Store(tmp_path / "c.sqlite")
    for (defense, f), acc in level.items():
        fields = trusted if defense == "fltrust" else DEFENSES[defense]
        for seed in range(5):
            a = acc - 0.001 * seed if defense == "mean" else acc + 0.01 * seed
            add(store, a, norm="fbn", f=f, gamma=0.1, lr=0.05, seed=seed, **fields, **ATTACKS["sf-mean"])
    runs = store.rows()
    store.close()
    (tmp_path / "scenarios").mkdir()
    (tmp_path / tables.ROBUSTNESS_MATRIX).write_text((ROOT / tables.ROBUSTNESS_MATRIX).read_text())
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: [
        r for r in runs if x is None or float(r[tables.SWEEPS[x][0]]) == tables.SWEEPS[x][1]])
    words = {t["defense"]: t for t in worst_case(runs, ("lr",))}
    name = {d: next(w for w in words if (d == "fltrust") == ("fltrust" in w) and (d != "mean") == ("median" in w))
            for d in ("mean", "nnm+median", "fltrust")}
    monkeypatch.setattr(tables, "search_notes", lambda: {("fbn", None, 0.1, 4, name["nnm+median"]): ", not searched yet"})
    tables.curve_findings()
    out = capsys.readouterr().out.splitlines()
    row = lambda *start: next(line for line in out if line.startswith("| " + " | ".join(start) + " |"))
    short = {d: compact_defense(w) for d, w in name.items()}  # a phone's width: each channel in a word
    assert row("FBN", short["mean"], "f (gamma = 0.1)").endswith("| both at or below chance |")
    free = row("FBN", short["nnm+median"], "f (gamma = 0.1)")
    assert "| f = 1: 72.0 [" in free and "| f = 4: 32.0 [" in free and ", not searched yet |" in free
    assert free.endswith("| -40.0 [-40.0, -40.0] (5 pairs; lower) |")
    assert row("FBN", short["fltrust"] + " (trusted)", "f (gamma = 0.1)").endswith(
        "| -5.0 [-5.0, -5.0] (5 pairs; lower) |")
    assert f"(trusted): the server's data, {words[name['fltrust']]['server_data']}." in out  # named once
    # per point: trusted against the root-free pick (nnm+median, never the mean at chance)
    at_1, at_4 = row("FBN", "0.1", "1"), row("FBN", "0.1", "4")
    assert f"| {short['nnm+median']}: 72.0 [" in at_1 and at_1.endswith("| -10.0 [-10.0, -10.0] (5 pairs; lower) |")
    assert ", not searched yet | +25.0 [25.0, 25.0] (5 pairs; higher) |" in at_4
    assert not any(line.startswith("| FBN | 0.1 | 2 |") for line in out)
    # a point still waiting for a planned root-free defense names no highest and no difference
    monkeypatch.setattr(tables, "expected_defenses", lambda norm, threat, gamma, f: 3 if f == 4 else 2)
    tables.curve_findings()
    out = capsys.readouterr().out.splitlines()
    assert row("FBN", "0.1", "4").endswith("| 2 of 3 finished, no pick yet | - |")
    assert row("FBN", "0.1", "1").endswith("| -10.0 [-10.0, -10.0] (5 pairs; lower) |")


def test_the_same_defense_across_protocols_calls_two_models_at_chance_both_at_chance(tmp_path, capsys):
    """same_defense: two protocols whose undefended mean both sit at chance differ by hundredths of
    a point on every seed, which a paired interval can call "higher"; the row says "both at
    chance". A defense above chance keeps its paired verdict."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.store import Store

    level = {("fbn", "mean"): 0.1, ("naive", "mean"): 0.1003, ("fbn", "nnm+median"): 0.5,
             ("naive", "nnm+median"): 0.6}
    with Store(tmp_path / "s.sqlite") as store:
        for (norm, defense), acc in level.items():
            for seed in range(5):  # each seed a little higher: the paired gap is the same on every seed
                add(store, acc + 0.0001 * seed * (norm == "naive"), norm=norm, f=3, gamma=0.0, lr=0.05,
                    seed=seed, **DEFENSES[defense], **ATTACKS["sf-mean"])
        runs = store.rows()
    tables.same_defense(runs, ["fbn", "naive"])
    out = capsys.readouterr().out.splitlines()
    mean_row = next(line for line in out if line.startswith("| mean | 0, 3 |"))
    assert mean_row.endswith(", both at or below chance |") and "higher" not in mean_row
    other = next(line for line in out if line.startswith("| ") and "median" in line)
    assert other.endswith(", +10.0 [10.0, 10.0] (5 pairs; higher) |")


def test_curve_searches_list_the_picks_that_decide_a_protocol_verdict(tmp_path, monkeypatch, capsys):
    """A point where each protocol has one defense (no map choice to turn): the protocol that
    stands highest is searched, since a stronger attack could turn which protocol is highest; the
    one below it is not (lowering it turns nothing). Once the two are tied, both are."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, BASE, DEFENSES, add

    from robustbn.evaluate import toml_text
    from robustbn.store import Store

    tuned_dir = tmp_path / tables.TUNED_DIR
    tuned_dir.mkdir(parents=True)
    noise = [0.00, 0.03, -0.02, 0.01, -0.01]

    def runs_at(level: dict[str, list[float]]) -> list[dict]:
        with Store(tmp_path / f"{len(list(tmp_path.iterdir()))}.sqlite") as store:
            for norm, accs in level.items():
                values = {**BASE, "norm": norm, "f": 3, "gamma": 1.0, "lr": 0.05, "seed": list(range(5)),
                          **DEFENSES["mean"]}
                (tuned_dir / f"tuned_{norm}_mean.toml").write_text(toml_text(values))
                for seed, acc in enumerate(accs):
                    add(store, acc, norm=norm, f=3, gamma=1.0, lr=0.05, seed=seed, **DEFENSES["mean"],
                        **ATTACKS["sf-mean"])
            return store.rows()

    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "_search_space", lambda norm, defense: f"scenarios/search_{norm}.toml")
    runs = runs_at({"fbn": [0.3 + e for e in noise], "naive": [0.6 + e for e in noise]})
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    tables.curve_searches()
    out = capsys.readouterr().out
    assert "Of these 1, 0 are fully searched" in out
    assert "| naive BN | root-free | 1 | 3 | mean (lr 0.05) | 60.2 [" in out and "| the protocol verdict | not yet |" in out
    (command,) = [line for line in out.splitlines() if line.startswith("robustbn attack-search")]
    assert f"--on {tables.TUNED_DIR}/tuned_naive_mean.toml" in command
    # while the point's lr is tuned again (a wider grid), its tuned file may move: the search waits
    monkeypatch.setattr(tables, "unsettled_points", lambda: {("naive", "mean", 1.0, 3)})
    tables.curve_searches()
    out = capsys.readouterr().out
    assert "| not yet (its lr is being tuned again: the search waits for it) |" in out
    assert "robustbn attack-search" not in out
    monkeypatch.setattr(tables, "unsettled_points", set)
    runs = runs_at({"fbn": [0.5 + e for e in noise], "naive": [0.5 + e for e in noise[2:] + noise[:2]]})
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    tables.curve_searches()
    out = capsys.readouterr().out
    assert "Of these 2, 0 are fully searched" in out
    assert sorted(line.split(" --on ")[1].split()[0] for line in out.splitlines() if line.startswith("robustbn attack-search")) \
        == [f"{tables.TUNED_DIR}/tuned_fbn_mean.toml", f"{tables.TUNED_DIR}/tuned_naive_mean.toml"]


def test_the_maps_tied_rows_hold_0_in_their_gap_and_its_lone_picks_exclude_it():
    """In the shipped results.md map, a defense "tied" with a cell's first has a paired gap whose
    95% interval holds 0, and the defense "next, lower by" under a pick or a tied set one that excludes it:
    the words and the numbers beside them say the same."""
    rows = re.findall(r"^\|  \| (tied, gap|next, lower by) (-?[\d.]+) \[(-?[\d.]+), (-?[\d.]+)\] \((\d+) pairs\) \|",
                      RESULTS.read_text("utf-8"), re.M)
    assert {kind for kind, *_ in rows} == {"tied, gap", "next, lower by"}
    for kind, gap, low, high, pairs in rows:
        low, high = float(low), float(high)
        assert low <= float(gap) <= high and int(pairs) >= 3
        assert (low <= 0 <= high) if kind == "tied, gap" else low > 0


def test_the_curves_defense_agrees_with_the_board_only_where_its_own_row_leads(tmp_path, monkeypatch, capsys):
    """curve_defenses: every protocol runs nnm+trmean and the mean anyway, so a board led by
    nnm+trmean does not agree with FBN's file, whose own row is bucketing+cc; a board led by
    bucketing+cc does."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, add

    from robustbn.store import Store

    rows = {"nnm+trmean": dict(grad_agg="nnm+trmean", bn_agg="nnm+trmean"), "mean": dict(bn_agg="mean"),
            "bucketing+cc": dict(grad_agg="bucketing+cc", grad_agg_params={"center": "previous", "tau": 1.0},
                                 bn_agg="nnm+trmean")}

    def fbn_row(leader: str) -> str:
        with Store(tmp_path / f"{leader}.sqlite") as store:
            for seed in range(5):
                for defense, fields in rows.items():
                    acc = (0.6 if defense == leader else 0.2) + 0.01 * seed
                    add(store, acc, norm="fbn", f=3, gamma=0.0, lr=0.05, seed=seed, **fields, **ATTACKS["sf-mean"])
            runs = store.rows()
        monkeypatch.setattr(tables, "board_runs", lambda: runs)
        tables.curve_defenses()
        (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| FBN |")]
        return row

    row = fbn_row("nnm+trmean")
    assert row.split(" | ")[1] == "bucketing+cc (center=previous, tau=1.0) on the gradients, nnm+trmean on the mean " \
                                  "and variance"
    assert row.startswith("| FBN |") and row.endswith("| no |") and "nnm+trmean (62.0, best)" in row
    assert fbn_row("bucketing+cc").endswith("| yes |")


def test_tuning_at_the_boards_point_pairs_the_boards_lr_with_the_tuned_one(tmp_path, monkeypatch, capsys):
    """tuning_at_board_point: at gamma = 0, f = 3, each defense on the board (the matrix's lr) and
    on the curves (its tuned lr), paired by seed; a side searched against one that is not says so,
    since the unsearched worst case can still fall."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import ATTACKS, DEFENSES, add

    from robustbn.store import Store

    with Store(tmp_path / "c.sqlite") as store:
        board, curve = [], []
        for seed in range(5):
            for defense, at_board, tuned in (("mean", 0.1, 0.1), ("nnm+median", 0.5, 0.3)):
                fields = dict(norm="fbn", f=3, gamma=0.0, seed=seed, **DEFENSES[defense], **ATTACKS["sf-mean"])
                board.append(add(store, at_board + 0.01 * seed * (defense != "mean"), lr=0.05, **fields))
                curve.append(add(store, tuned + 0.02 * seed * (defense != "mean"), lr=0.01, **fields))
        runs = store.rows()
    searched = "scenarios/searched_worst_fbn_nnm_median.toml"  # the board's search, confirmed
    runs = [{**r, "source": searched} if r["hash"] in board and r["bn_agg"] == "nnm+median" else r for r in runs]
    monkeypatch.setattr(tables, "board_runs", lambda: [r for r in runs if r["hash"] in board])
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: [r for r in runs if r["hash"] in curve])
    tables.tuning_at_board_point()
    out = capsys.readouterr().out
    rows = {line.split(" | ")[1]: line for line in out.splitlines() if line.startswith("| FBN |")}
    assert rows["mean"].endswith("| both at or below chance |")
    row = rows["mean (grad), nnm+median (BN)"]
    assert "| 52.0 [" in row and "(5 seeds), searched; worst: SF (mean) | lr 0.01: 34.0 [" in row
    # every seed lower by 0.2 - 0.01 * seed: -18.0 on average, its interval below 0
    assert re.search(r"\| -18\.0 \[-[\d.]+, -[\d.]+\] \(5 pairs; lower\); the tuned side not searched yet \|$", row)


def test_a_curve_search_tries_the_boards_confirmed_attacks_on_the_same_defense(tmp_path, monkeypatch, capsys):
    """The board's confirmation files (scenarios/searched_worst_*.toml: gamma = 0, the matrix's
    lr) are the same defense at another point: a curve search of that defense tries their attacks
    (--try), those its search space holds; a board file of another defense, or of an attack
    outside the space, is no --try of it."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import shutil

    import tables
    from test_worst_case import ATTACKS, BASE, DEFENSES, add

    from robustbn.evaluate import toml_text
    from robustbn.store import Store

    tuned_dir = tmp_path / tables.TUNED_DIR
    tuned_dir.mkdir(parents=True)
    shutil.copy(ROOT / "scenarios" / "search_fbn_nnm_trmean_heldout.toml", tmp_path / "scenarios" / "search_fbn.toml")
    with Store(tmp_path / "c.sqlite") as store:
        for d, defense in enumerate(DEFENSES):
            values = {**BASE, "norm": "fbn", "f": 3, "gamma": 1.0, "lr": 0.01, "seed": list(range(5)),
                      **DEFENSES[defense]}
            (tuned_dir / f"tuned_fbn_{defense.replace('+', '_')}_gamma_1.toml").write_text(toml_text(values))
            for seed in range(5):  # nnm+median the pick, well above chance
                add(store, 0.3 + 0.5 * d + 0.01 * seed, norm="fbn", f=3, gamma=1.0, lr=0.01, seed=seed,
                    **DEFENSES[defense], **ATTACKS["sf-mean"])
        runs = store.rows()
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    monkeypatch.setattr(tables, "_search_space", lambda norm, defense: "scenarios/search_fbn.toml")
    board = {**BASE, "norm": "fbn", "f": 3, "gamma": 0.0, "lr": 0.05, "seed": list(range(5))}
    files = {"searched_worst_fbn_nnm_median.toml": {**DEFENSES["nnm+median"], "grad_attack": "ipm",
                                                     "grad_attack_params": {"eps": 0.5}},
             "searched_worst_fbn_nnm_median_foe.toml": {**DEFENSES["nnm+median"], "grad_attack": "foe"},
             "searched_worst_fbn_mean.toml": {**DEFENSES["mean"], "grad_attack": "ipm",
                                              "grad_attack_params": {"eps": 2.0}}}
    for name, fields in files.items():
        (tmp_path / "scenarios" / name).write_text(toml_text({**board, **fields}))
    (command,) = [c for c in tables.curve_search_rows()[1] if "nnm_median" in c.split(" --on ")[1].split()[0]]
    assert command.count("--try") == 1 and "--try scenarios/searched_worst_fbn_nnm_median.toml " in command
    # once the point's search has tried it (its confirmation's description names the attack), it is done
    confirm = command.split("--confirm ")[1].split()[0]
    tried = tables.attack_of("scenarios/searched_worst_fbn_nnm_median.toml")
    (tmp_path / confirm).write_text(toml_text({**board, "gamma": 1.0, "lr": 0.01, **DEFENSES["nnm+median"],
                                               **ATTACKS["sf-mean"], "description": f"it tried too x.toml ({tried})"}))
    monkeypatch.setattr(tables, "all_finished", lambda path: True)
    monkeypatch.setattr(tables, "own_seed_runs", lambda path: [r for r in runs if r["bn_agg"] == "nnm+median"])
    assert not [c for c in tables.curve_search_rows()[1] if "nnm_median" in c.split(" --on ")[1].split()[0]]


def test_the_boards_search_tries_the_curves_confirmed_attacks_on_the_same_defense(tmp_path, monkeypatch, capsys):
    """The other way round: an attack confirmed at a curve point (another lr, another gamma) is
    tried by the board's search of the same defense (--try, at the board's setting), those its
    space holds; the command writes the search's report by a file of its own and reruns the
    confirmation. Once the board's confirmation names the attack and its runs have finished,
    nothing is left; a new curve attack lists the search again with every attack (a confirmation
    names only its own command's tries), and so does a confirmation whose runs were cut short."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import shutil

    import tables
    from test_worst_case import ATTACKS, BASE, DEFENSES

    from robustbn.evaluate import toml_text

    tuned_dir = tmp_path / tables.TUNED_DIR
    tuned_dir.mkdir(parents=True)
    shutil.copy(ROOT / "scenarios" / "search_fbn_nnm_trmean_heldout.toml",
                tmp_path / "scenarios" / "search_fbn_nnm_median.toml")
    board = {**BASE, "norm": "fbn", "f": 3, "gamma": 0.0, "lr": 0.05, "seed": list(range(5))}
    board_confirm = "scenarios/searched_worst_fbn_nnm_median.toml"

    def confirmed(description: str) -> None:
        (tmp_path / board_confirm).write_text(toml_text({**board, **DEFENSES["nnm+median"], **ATTACKS["sf-mean"],
                                                         "description": description}))
    confirmed("The worst attack that robustbn attack-search")
    curve = {**BASE, "norm": "fbn", "f": 3, "gamma": 1.0, "lr": 0.01, "seed": list(range(5))}
    for defense in DEFENSES:
        for gamma in (1, 0.5):
            name = f"fbn_{defense.replace('+', '_')}_gamma_{gamma:g}.toml"
            (tuned_dir / f"tuned_{name}").write_text(toml_text({**curve, "gamma": gamma, **DEFENSES[defense]}))
    ipm = {"grad_attack": "ipm", "grad_attack_params": {"eps": 0.5}}
    files = {"searched_worst_fbn_nnm_median_gamma_1.toml": {**DEFENSES["nnm+median"], **ipm},
             "searched_worst_fbn_nnm_median_gamma_1_earlier_1.toml": {**DEFENSES["nnm+median"], "grad_attack": "foe"},
             "searched_worst_fbn_mean_gamma_1.toml": {**DEFENSES["mean"], "grad_attack": "alie"}}
    for name, fields in files.items():
        (tuned_dir / name).write_text(toml_text({**curve, **fields}))
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    finished = {board_confirm: True}
    monkeypatch.setattr(tables, "all_finished", lambda path: finished.get(path, True))

    rows, (command,) = tables.board_try_rows()
    tried = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_gamma_1.toml"
    foe = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_gamma_1_earlier_1.toml"
    assert [(row[0], row[2], row[3], row[4], row[5]) for row in rows] == \
        [("fbn", "scenarios/search_fbn_nnm_median.toml", (tried, foe), (tried,), [tried])]  # FOE: outside the space
    assert command.startswith("robustbn attack-search scenarios/search_fbn_nnm_median.toml --try ")
    assert command.count("--try") == 1 and f"--try {tried} " in command
    assert (f"--confirm {board_confirm} > docs/search_fbn_nnm_median.json.$$.tmp && mv docs/search_fbn_nnm_median.json.$$.tmp "
            f"docs/search_fbn_nnm_median.json && robustbn run {board_confirm} ") in command
    tables.board_tries()
    out = capsys.readouterr().out
    assert "Of the 1 board searches with such an attack in their space, 0 have tried every one, 1 not yet." in out
    assert "| FBN | mean (grad), nnm+median (BN) | 1 | 0 | 1 |" in out  # one in its space, tried by none, FOE outside
    words = tables.attack_of(tried)
    confirmed(f"...; it tried too x.toml ({words})")
    assert tables.board_try_rows()[1] == ()
    tables.board_tries()
    out = capsys.readouterr().out
    assert "1 have tried every one, 0 not yet" in out and "robustbn attack-search" not in out
    # its confirmation's runs cut short (a halt between the search and `robustbn run`): listed again
    finished[board_confirm] = False
    (command,) = tables.board_try_rows()[1]
    assert f"--try {tried} " in command and command.endswith(f"robustbn run {board_confirm} --db results/board.sqlite "
                                                             f"--quiet --yes")
    finished[board_confirm] = True
    # a new attack at another point: the search is listed with both, or the first would read untried afterwards
    other = f"{tables.TUNED_DIR}/searched_worst_fbn_nnm_median_gamma_0.5.toml"
    (tmp_path / other).write_text(toml_text({**curve, "gamma": 0.5, **DEFENSES["nnm+median"], "grad_attack": "ipm",
                                               "grad_attack_params": {"eps": 2.0}}))
    (command,) = tables.board_try_rows()[1]
    assert command.count("--try") == 2 and f"--try {tried} " in command and f"--try {other} " in command


def test_a_curve_point_where_naive_bn_beats_fbn_under_seed_002s_pipeline_is_a_disagreement(
        tmp_path, monkeypatch, capsys):
    """curve_disagreements: under nnm+trmean on every message, a root-free point where naive BN's
    worst case stands above FBN's (paired over seeds) is a line of its own that says it is not
    seed 002's setting; FBN above, tied or both at chance are counted in one line; a trusted
    defense, or a point where one protocol has not finished, says nothing."""
    sys.path.insert(0, str(ROOT / "docs"))
    sys.path.insert(0, str(ROOT / "tests"))
    import tables
    from test_worst_case import add

    from robustbn.store import Store

    trmean = dict(grad_agg="nnm+trmean", bn_agg="nnm+trmean")
    # (gamma, f): (FBN, naive BN) worst case; None: that protocol has not run there
    level = {(1.0, 3): (0.70, 0.80), (0.1, 1): (0.40, 0.12), (0.5, 3): (0.50, None), (0.0, 3): (0.1, 0.1002)}
    with Store(tmp_path / "s.sqlite") as store:
        for (gamma, f), accs in level.items():
            for norm, acc in zip(("fbn", "naive"), accs):
                for seed in range(5) if acc is not None else ():
                    for attack in ("sf", "alie"):  # ALIE the worst, by 0.05 on every seed
                        add(store, acc + 0.003 * seed + 0.05 * (attack == "sf"), norm=norm, f=f, gamma=gamma,
                            lr=0.05, seed=seed, grad_attack=attack, **trmean)
        runs = store.rows()
    monkeypatch.setattr(tables, "curve_runs", lambda x=None: runs)
    monkeypatch.setattr(tables, "confirmed_points", dict)
    tables.curve_disagreements()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2, out
    assert out[0].startswith("- the robustness curves, root-free, gamma = 1, f = 3, nnm+trmean on every message")
    assert "not its setting" in out[0] and "FBN 70.6 [" in out[0] and "naive BN 80.6 [" in out[0]
    assert out[0].endswith("difference -10.0 [-10.0, -10.0] (5 pairs; lower)")
    assert out[1] == ("- the curves' other root-free points under nnm+trmean, FBN against naive BN, at (gamma, f): "
                      "both at or below chance at (0, 3); higher at (0.1, 1)")
