"""The leaderboard (robustbn.report, `robustbn report`): its numbers against an independent
recomputation with scipy on a hand-made store, and the page in a real browser (Playwright
driving Debian's chromium)."""

import json
import sqlite3
import shutil
from pathlib import Path

import pytest
from scipy import stats

from robustbn.report import COLUMNS, KEYS, leaderboard, read_rows, rows_json, write_page
from robustbn.scenario import Scenario
from robustbn.store import Store, scenario_hash
from test_worst_case import toml_text

BASE = dict(dataset="synthetic-images", model="simple-cnn", partition="gamma", gamma=0.0, n=10, f=3, rounds=6,
            batch_size=8, eval_every=3)
DEFENSES = {"mean": dict(bn_agg="mean"), "nnm+median": dict(bn_agg="nnm+median"),
            "trmean": dict(bn_agg="trmean"), "fltrust": dict(grad_agg="fltrust", bn_agg="nnm+median")}
NAN = float("nan")  # a diverged run: it counts at chance, 1 / 10 classes
CATALOGUE = {"sf-mean": dict(grad_attack="none", bn_mean_attack="sf", bn_var_attack="honest"),
             "alie-grad": dict(grad_attack="alie", bn_mean_attack="honest", bn_var_attack="honest")}
HONEST = dict(grad_attack="honest", bn_mean_attack="honest", bn_var_attack="honest")
SEARCHED = dict(grad_attack="ipm", grad_attack_params={"eps": 1.5}, bn_mean_attack="sf", bn_var_attack="honest")
# final accuracy per seed 0-4 of (norm, defense, attack); "clean": every Byzantine channel honest
ACC = {
    ("fbn", "mean", "sf-mean"): (0.30, 0.34, 0.28, 0.33, 0.31),
    ("fbn", "mean", "alie-grad"): (0.60, 0.58, 0.66, 0.61, 0.64),
    ("fbn", "mean", "clean"): (0.80, 0.82, 0.79, 0.81, 0.83),
    ("fbn", "nnm+median", "sf-mean"): (0.70, 0.72, 0.69, 0.75, 0.71),
    ("fbn", "nnm+median", "alie-grad"): (0.55, 0.57, 0.52, 0.58, 0.56),
    ("fbn", "nnm+median", "clean"): (0.78, 0.80, 0.77, 0.79, 0.81),
    ("fbn", "trmean", "sf-mean"): (0.60, 0.50, 0.62, 0.45, 0.58),
    ("fbn", "trmean", "alie-grad"): (0.58, 0.61, 0.57, 0.66, 0.60),
    ("naive", "mean", "sf-mean"): (0.20, NAN, 0.22, NAN, 0.21),
    ("naive", "mean", "alie-grad"): (0.50, 0.52, 0.49, 0.51, 0.53),
    ("naive", "nnm+median", "sf-mean"): (0.60, 0.62, 0.61, 0.59, 0.63),
    ("naive", "nnm+median", "alie-grad"): (0.48, 0.47, 0.50, 0.46, 0.49),
    ("fbn", "fltrust", "sf-mean"): (0.75, 0.77, 0.74, 0.76, 0.78),
    ("fbn", "fltrust", "alie-grad"): (0.70, 0.72, 0.69, 0.71, 0.73),
    ("fbn", "fltrust", "clean"): (0.80, 0.81, 0.79, 0.80, 0.82),
}
CHANCE = 0.1
# the searched attack on FBN + nnm+median, seeds 0-6: lower than the catalogue's worst (ALIE, 0.556)
SEARCHED_ACC = (0.30, 0.62, 0.28, 0.55, 0.33, 0.31, 0.36)
F0_CLEAN = {"naive": (0.90, 0.91, 0.92, 0.90, 0.89)}  # naive has no honest runs: f = 0 stands in


def run(store, acc, **fields):
    sc = Scenario(**{**BASE, **fields}).validated().to_dict()
    store.finish(scenario_hash(sc), sc, [{"round": 6, "test_acc": acc, "test_loss": 1.0, "train_loss": 1.0}], {},
                 1.0, "cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A store, the matrix files that list its runs (catalogue, clean, searched, f = 0)."""
    tmp = tmp_path_factory.mktemp("report")
    store = Store(tmp / "s.sqlite")
    for (norm, defense, attack), accs in ACC.items():
        for seed, acc in enumerate(accs):
            run(store, acc, seed=seed, norm=norm, **DEFENSES[defense], **(HONEST if attack == "clean" else CATALOGUE[attack]))
    for seed, acc in enumerate(SEARCHED_ACC):
        run(store, acc, seed=seed, norm="fbn", **DEFENSES["nnm+median"], **SEARCHED)
    for seed, acc in enumerate(F0_CLEAN["naive"]):
        run(store, acc, seed=seed, norm="naive", f=0, bn_agg="mean")
    run(store, 0.01, seed=0, norm="fbn", **DEFENSES["mean"], grad_attack="ipm", grad_attack_params={"eps": 99.0})  # a trial
    store.close()
    seeds = list(range(5))
    catalogue = tmp / "worst_case.toml"
    catalogue.write_text(toml_text({**BASE, "seed": seeds, "norm": ["fbn", "naive"], "bn_agg": ["mean", "nnm+median",
                                                                                                  "trmean"],
                                    "grad_attack": ["none", "alie"], "bn_mean_attack": ["sf", "honest"],
                                    "bn_var_attack": "honest"})
                         + '[[exclude]]\ngrad_attack = "none"\nbn_mean_attack = "honest"\n'
                         + '[[exclude]]\ngrad_attack = "alie"\nbn_mean_attack = "sf"\n'
                         + '[[exclude]]\nnorm = "naive"\nbn_agg = "trmean"\n')
    clean = tmp / "clean.toml"
    clean.write_text(toml_text({**BASE, "seed": seeds, "norm": "fbn", "bn_agg": ["mean", "nnm+median"], **HONEST}))
    trusted = tmp / "trusted.toml"  # a defense with the server's root set: the other threat model
    trusted.write_text(toml_text({**BASE, "seed": seeds, "norm": "fbn", **DEFENSES["fltrust"],
                                  "grad_attack": ["none", "alie", "honest"], "bn_mean_attack": ["sf", "honest"],
                                  "bn_var_attack": "honest"})
                       + '[[exclude]]\ngrad_attack = "none"\nbn_mean_attack = "honest"\n'
                       + '[[exclude]]\ngrad_attack = ["alie", "honest"]\nbn_mean_attack = "sf"\n')
    f0 = tmp / "f0.toml"
    f0.write_text(toml_text({**BASE, "seed": seeds, "norm": "naive", "f": 0, "bn_agg": "mean"}))
    searched = tmp / "searched_worst_fbn_nnm_median.toml"
    searched.write_text(toml_text({**BASE, "seed": list(range(7)), "norm": "fbn", **DEFENSES["nnm+median"], **SEARCHED}))
    return tmp / "s.sqlite", [str(catalogue), str(clean), str(f0), str(searched), str(trusted)]


def board_of(setup):
    db, files = setup
    with Store(db, readonly=True) as store:
        return leaderboard(read_rows(store.rows(), files))


# ---- an independent recomputation: scipy on the hand-made numbers -----------------------------

def expected(norm, defense):
    """(worst mean, its interval, seeds, worst attack's per-seed values, source) from ACC with scipy."""
    attacks = {a: [CHANCE if v != v else v for v in vs] for (n, d, a), vs in ACC.items()
               if (n, d) == (norm, defense) and a != "clean"}
    if (norm, defense) == ("fbn", "nnm+median"):
        attacks["searched"] = list(SEARCHED_ACC)
    name = min(attacks, key=lambda a: sum(attacks[a]) / len(attacks[a]))
    v = attacks[name]
    mean = sum(v) / len(v)
    low, high = stats.t.interval(0.95, len(v) - 1, loc=mean, scale=stats.sem(v))
    return mean, (max(low, 0.0), min(high, 1.0)), len(v), v, name


def test_the_leaderboards_numbers_equal_scipy_on_the_store(setup):
    board = board_of(setup)
    rows = {(r["norm"], r["defense"]): r for r in board.rows}
    robust = "mean on the gradients, nnm+median on the mean and variance"
    trimmed = "mean on the gradients, trmean on the mean and variance"
    trust = "fltrust on the gradients, nnm+median on the mean and variance"
    names = {"mean": "mean", "nnm+median": robust, "trmean": trimmed, "fltrust": trust}
    # within a protocol, the highest worst case first
    assert list(rows) == [("naive", robust), ("naive", "mean"), ("fbn", trust), ("fbn", trimmed), ("fbn", robust),
                          ("fbn", "mean")]
    for norm, defense in {(n, d) for n, d, _ in ACC}:
        r = rows[norm, names[defense]]
        mean, (low, high), n, _, name = expected(norm, defense)
        assert r["worst_acc"] == pytest.approx(mean) and r["seeds"] == n
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((low, high))
        clean = ACC.get((norm, defense, "clean")) or (F0_CLEAN["naive"] if (norm, defense) == ("naive", "mean") else None)
        if clean is None:
            assert r["clean_acc"] is None and r["clean_kind"] is None
        else:
            assert r["clean_acc"] == pytest.approx(sum(clean) / 5) and r["clean_seeds"] == 5
            assert r["clean_kind"] == ("f = 0" if norm == "naive" else "honest")
        assert (r["worst_kind"] == "searched") == (name == "searched")
    # the searched attack is FBN + nnm+median's worst, on its own 7 seeds, named with its file and messages
    r = rows["fbn", robust]
    assert r["worst_attack"] == "IPM (eps=1.5) on the gradients + SF on the mean"
    assert r["worst_source"].endswith("searched_worst_fbn_nnm_median.toml") and r["seeds"] == 7
    assert r["attacks_run"] == 3 and rows["fbn", "mean"]["attacks_run"] == 2 and r["searched"].endswith(
        "searched_worst_fbn_nnm_median.toml") and rows["fbn", "mean"]["searched"] is None
    # threat models: only the root-set rule is marked, and it is ranked apart (alone: no verdict)
    assert {k: v["server_data"] for k, v in rows.items() if v["server_data"]} == {
        ("fbn", trust): "root set of 100, drawn uniformly (about class-balanced)"}
    assert rows["fbn", trust]["verdict"] is None
    # a diverged run counts at chance, and the cell says how many of its runs diverged
    assert rows["naive", "mean"]["diverged"] == 2 and rows["naive", robust]["diverged"] == 0
    # verdicts: the best by mean, each other paired with it on the seeds both ran (ttest_rel's interval)
    for norm, defenses in (("naive", ("mean", "nnm+median")), ("fbn", ("mean", "nnm+median", "trmean"))):  # root-free
        worst = {d: expected(norm, d) for d in defenses}
        best = max(defenses, key=lambda d: worst[d][0])
        verdicts = {}
        for d in defenses:
            if d == best:
                continue
            k = min(len(worst[d][3]), len(worst[best][3]))
            ci = stats.ttest_rel(worst[best][3][:k], worst[d][3][:k]).confidence_interval(0.95)
            verdicts[d] = "worse" if ci.low > 0 or ci.high < 0 else "tied for best"
            assert rows[norm, names[d]]["gap"] == pytest.approx(sum(worst[best][3][:k]) / k - sum(worst[d][3][:k]) / k)
            assert (rows[norm, names[d]]["gap_low"], rows[norm, names[d]]["gap_high"]) == pytest.approx((ci.low, ci.high))
        verdicts[best] = "best" if all(v == "worse" for v in verdicts.values()) else "tied for best"
        assert {names[d]: rows[norm, names[d]]["verdict"] for d in defenses} == {names[d]: v for d, v in verdicts.items()}
    # the hand-made numbers cover each verdict: naive's best outright; under FBN trmean tied with the
    # searched attack's spread, the mean worse
    assert rows["naive", robust]["verdict"] == "best" and rows["fbn", trimmed]["verdict"] == "tied for best"
    assert rows["fbn", robust]["verdict"] == "tied for best" and rows["fbn", "mean"]["verdict"] == "worse"


def test_recommendations_per_threat_model_follow_the_verdicts(setup):
    board = board_of(setup)
    assert board.lines[:2] == [
        "with naive BN, root-free: use mean on the gradients, nnm+median on the mean and variance (48.0% [46.0, 50.0], "
        "5 seeds); every other defense is lower, paired over seeds",
        "with naive BN, trusted server data: no defense run"]
    # FBN's best root-free defense is tied: every tied row is named and none is picked
    assert board.lines[2].startswith("with FBN, root-free: no single pick, 2 tied for best: mean on the gradients, "
                                     "trmean on the mean and variance (")
    mean, (low, high), n, _, _ = expected("fbn", "nnm+median")
    assert board.lines[2].endswith(f"; mean on the gradients, nnm+median on the mean and variance ({100 * mean:.1f}% "
                                   f"[{100 * low:.1f}, {100 * high:.1f}], {n} seeds)") and " use " not in board.lines[2]
    assert board.lines[3] == ("with FBN, trusted server data (root set of 100, drawn uniformly (about class-balanced)): "
                              "fltrust on the gradients, nnm+median on the mean and variance (71.0% [69.0, 73.0], "
                              "5 seeds), the only such defense run")
    assert [p for p, _ in board.absent] == ["fedbn", "silobn", "fedwon", "fbn-scale"]
    assert all(reason for _, reason in board.absent)


def test_the_board_compares_the_protocols_each_at_its_highest_row(setup):
    """Board.protocols: naive BN and FBN each at their highest root-free row, paired by seed as
    scipy pairs them; FBN alone has a trusted row (naive BN none: not waited for); the page's
    section holds the verdict back as provisional over the picks no search was confirmed
    against."""
    import re

    from robustbn.report import board_protocols_html

    board = board_of(setup)
    (free,) = [c for c in board.protocols if c["threat"] is None]
    top = {p["norm"]: p for p in free["protocols"]}
    for norm in ("naive", "fbn"):  # each protocol's highest row of the board
        best = max((r for r in board.rows if r["norm"] == norm and not r["server_data"]), key=lambda r: r["worst_acc"])
        assert (top[norm]["defense"], top[norm]["worst_acc"]) == (best["defense"], pytest.approx(best["worst_acc"]))
    first, second = free["protocols"][0], free["protocols"][1]  # the higher first; the gap: first - second
    pairs = [first["worst_by_seed"][k] - second["worst_by_seed"][k] for k in second["worst_by_seed"]]
    ci = stats.t.interval(0.95, len(pairs) - 1, loc=sum(pairs) / len(pairs), scale=stats.sem(pairs))
    assert (second["gap"], second["gap_low"], second["gap_high"]) == pytest.approx((sum(pairs) / len(pairs), *ci))
    (trusted,) = [c for c in board.protocols if c["threat"] is not None]
    assert [p["norm"] for p in trusted["protocols"]] == ["fbn"]
    page = board_protocols_html(board)
    # the board's one lr in the caption: the curves' table of the same point, at tuned lrs, reads differently
    assert "<caption>Which BN protocol, root-free, every defense at the board&#x27;s lr 0.1: " in page
    heads = re.findall(r"<td><b>(.*?)</b></td>", page)
    assert heads[1] == "only FBN run"  # naive BN has no trusted row at all: nothing is missing
    # FBN's top (trmean on the statistics) has no search here (the fixture searched its nnm+median row)
    assert top["fbn"]["defense"] == "mean on the gradients, trmean on the mean and variance"
    assert heads[0] == "2 tied; provisional: no attack search confirmed against FBN, naive BN"


def test_use_lines_never_outrun_the_verdict(setup):
    """Every recommendation says "use" exactly where its row's verdict is best, and a tie names
    every row tied for best of its protocol and threat model."""
    from robustbn.report import ROOT_FREE, threat

    board = board_of(setup)
    for pick in board.recommendations:
        mine = [r for r in board.rows if r["norm"] == pick["norm"] and threat(r) == pick["threat"]]
        best = [r for r in mine if r["verdict"] == "best"]
        assert (": use " in pick["text"]) == bool(best)
        for r in mine:
            if r["verdict"] == "tied for best":
                assert r["defense"] in pick["text"] and "no single pick" in pick["text"]
    assert {p["threat"] for p in board.recommendations} == {ROOT_FREE, "trusted server data"}


def test_json_keys_and_runs(setup):
    board = board_of(setup)
    rows = rows_json(board)
    assert all(list(r)[:len(KEYS)] == list(KEYS) for r in rows)
    runs = {(r["norm"], r["defense"]): r for r in board.rows}[("fbn", "mean on the gradients, nnm+median on the mean "
                                                                       "and variance")]["runs"]
    assert len(runs) == 5 * 3 + 7 and all(set(run) >= {"seed", "hash", "code_version", "status"} for run in runs)
    assert sum(run["worst"] for run in runs) == 7


# ---- the page in a real browser -------------------------------------------------------------

def chromium_path():
    return shutil.which("chromium") or (Path("/usr/bin/chromium").is_file() and "/usr/bin/chromium") or None


def dom_text(r: dict) -> list[str]:
    """What a JSON row's cells must read, formatted here (not by robustbn.report)."""
    p = lambda v: f"{100 * v:.1f}"
    clean = "not run" if r["clean_acc"] is None else (
        f"{p(r['clean_acc'])} [{p(r['clean_low'])}, {p(r['clean_high'])}] ({r['clean_seeds']} seeds"
        + (", f = 0)" if r["clean_kind"] == "f = 0" else ")"))
    source = {"searched": f" (searched: {r['worst_source']})", "catalogue": " (catalogue)"}[r["worst_kind"]]
    worst = p(r["worst_acc"]) + (f" ({r['diverged']} of {r['seeds']} runs diverged)" if r["diverged"] else "")
    searched = f"{'yes' if r['searched'] else 'no'}; worst of {r['attacks_run']} attacks"
    names = {"naive": "naive BN", "fbn": "FBN"}
    return [names[r["norm"]], r["defense"], r["server_data"] or "none (root-free)", clean, worst,
            f"[{p(r['ci_low'])}, {p(r['ci_high'])}]", str(r["seeds"]), r["worst_attack"] + source, searched,
            r["verdict"] or "-"]


def test_the_page_in_chromium_equals_the_json_and_sorts(setup, tmp_path):
    if chromium_path() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; ./dev.sh test installs it where apt-get "
                    "is usable)")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    db, files = setup
    with Store(db, readonly=True) as store:
        rows = read_rows(store.rows(), files)
    page_path = write_page(rows, tmp_path / "site")
    board = leaderboard(rows)
    want = rows_json(board)
    requests, errors = [], []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page()
        page.on("request", lambda req: requests.append(req.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_path.as_uri())
        header = page.eval_on_selector_all("#leaderboard thead th", "ths => ths.map(t => t.textContent)")
        assert header == list(COLUMNS)
        assert "rows by protocol, then the highest worst case first" in page.text_content("#leaderboard caption")
        read = "trs => trs.map(tr => Array.from(tr.cells).map(td => td.textContent))"
        assert page.eval_on_selector_all("#leaderboard tr.entry", read) == [dom_text(r) for r in want]
        # the setup, the threat model and the picks stand above the table, in both threat models
        box = page.text_content("dl.box")
        assert all(w in box for w in ("synthetic-images", "n = 10", "f = 3", "6 rounds", "gamma = 0.0",
                                      "BN running means", "Trusted server data"))
        picks = page.eval_on_selector_all("#recommendations tbody tr", read)
        assert picks == [[{"naive": "naive BN", "fbn": "FBN"}[r["norm"]], r["pick"], t["pick"]]
                         for r, t in zip(board.recommendations[::2], board.recommendations[1::2])]
        assert page.evaluate("document.querySelector('#recommendations').getBoundingClientRect().top < "
                             "document.querySelector('#leaderboard').getBoundingClientRect().top")
        # every image inline: the page asked for nothing but itself
        assert requests == [page_path.as_uri()]
        assert page.eval_on_selector_all("img", "imgs => imgs.map(i => i.src.slice(0, 22))") == \
            ["data:image/png;base64,"] * len(page.query_selector_all("img"))
        assert all(page.eval_on_selector_all("img", "imgs => imgs.map(i => i.naturalWidth > 100)"))
        # the heatmap: an HTML table in %, one cell per row of the board
        heat = page.eval_on_selector_all("table.heat td", "tds => tds.map(t => t.firstChild.textContent)")
        assert sorted(x for x in heat if x != "-") == sorted(
            f"{100 * r['worst_acc']:.1f}" + (f" ({r['diverged']} of {r['seeds']} diverged)" if r["diverged"] else "")
            for r in want)
        # sort by worst-case accuracy with the keyboard: ascending, then descending
        by_worst = sorted(want, key=lambda r: r["worst_acc"])
        worst_button = "#leaderboard thead th:nth-child(5) button"
        page.focus(worst_button)
        page.keyboard.press("Enter")
        assert page.get_attribute("#leaderboard thead th:nth-child(5)", "aria-sort") == "ascending"
        assert page.eval_on_selector_all("#leaderboard tr.entry", read) == [dom_text(r) for r in by_worst]
        page.click(worst_button)
        assert page.get_attribute("#leaderboard thead th:nth-child(5)", "aria-sort") == "descending"
        assert page.eval_on_selector_all("#leaderboard tr.entry", read) == [dom_text(r) for r in by_worst[::-1]]
        page.click("#leaderboard thead th:nth-child(2) button")  # text: by defense
        defenses = page.eval_on_selector_all("#leaderboard tr.entry td:nth-child(2)", "tds => tds.map(t => t.textContent)")
        assert defenses == sorted(defenses)
        assert page.get_attribute("#leaderboard thead th:nth-child(5)", "aria-sort") == "none"
        # a row opens to its runs
        first = page.query_selector("#leaderboard tbody details")
        assert first.evaluate("d => d.open") is False
        page.click("#leaderboard tbody details summary >> nth=0")
        assert first.evaluate("d => d.open") is True
        runs_header = first.eval_on_selector_all("th", "ths => ths.map(t => t.textContent)")
        assert runs_header[:4] == ["seed", "hash", "code_version", "status"]
        shown = page.eval_on_selector_all("#leaderboard tr.entry", read)[0]
        runs = next(b["runs"] for b, r in zip(board.rows, want) if dom_text(r) == shown)
        assert [cells[:4] for cells in first.eval_on_selector_all("tr", read)[1:]] == \
            [[str(run["seed"]), run["hash"], run["code_version"] or "not recorded", run["status"]] for run in runs]
        # every header of the page, the runs tables' included, clicked: no page error, and only the
        # leaderboard's own headers sort
        order = page.eval_on_selector_all("#leaderboard tr.entry", read)
        page.eval_on_selector_all("details", "ds => ds.forEach(d => { d.open = true; })")
        for th in page.query_selector_all("details th"):
            th.click()
        assert page.eval_on_selector_all("#leaderboard tr.entry", read) == order
        for th in page.query_selector_all("th"):
            th.scroll_into_view_if_needed()
            th.click()
        assert errors == []
        # a phone: the page fits 390 px, its text stays readable, the table scrolls in its own box
        phone = browser.new_page(viewport={"width": 390, "height": 844}, device_scale_factor=3, is_mobile=True)
        phone.on("pageerror", lambda e: errors.append(str(e)))
        phone.goto(page_path.as_uri())
        assert phone.evaluate("document.documentElement.scrollWidth") <= 390
        assert float(phone.eval_on_selector("#leaderboard td", "td => getComputedStyle(td).fontSize")[:-2]) >= 14
        box = phone.eval_on_selector("#leaderboard", "t => [t.parentNode.scrollWidth, t.parentNode.clientWidth]")
        assert box[0] > box[1] and phone.eval_on_selector(
            "#leaderboard", "t => getComputedStyle(t.parentNode).overflowX") == "auto"
        # the tables of prose (the picks, the maps) wrap to the phone's width; the leaderboard and the heatmap scroll
        prose = phone.eval_on_selector_all(".scroll > table:not(#leaderboard):not(.heat)", "ts => ts.map(t => "
                                           "[t.parentNode.scrollWidth, t.parentNode.clientWidth])")
        assert prose and all(width <= room for width, room in prose), prose
        # a wide table's caption stays in view, whole, above its scrolling box
        edges = phone.eval_on_selector_all(".scroll caption", "cs => cs.map(c => [c.getBoundingClientRect().right, "
                                                              "c.closest('.scroll').getBoundingClientRect().right])")
        assert edges and all(right <= box_right + 0.5 for right, box_right in edges)
        for button in phone.query_selector_all("#leaderboard thead th button"):
            button.scroll_into_view_if_needed()
            button.click()
        assert errors == []
        browser.close()


# ---- the command ------------------------------------------------------------------------------

def test_report_command_json_markdown_and_page(setup, tmp_path, capsys):
    from robustbn.cli import main

    db, files = setup
    matrices = [a for f in files for a in ("--matrix", f)]
    assert main(["report", "--db", str(db), "--format", "json", *matrices]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = rows_json(board_of(setup))
    assert printed == json.loads(json.dumps(want))
    assert [list(r)[:len(KEYS)] for r in printed] == [list(KEYS)] * len(printed)
    assert main(["report", "--db", str(db), "--format", "markdown", *matrices]) == 0
    text = capsys.readouterr().out
    assert text.startswith("- with naive BN, root-free: use ") and "| " + " | ".join(COLUMNS) + " |" in text
    assert text.index("counts at chance") < text.index("| " + " | ".join(COLUMNS))  # the rule above the table
    assert main(["report", "--db", str(db), "--out", str(tmp_path / "site"), *matrices]) == 0
    page = (tmp_path / "site" / "index.html").read_text()
    assert capsys.readouterr().out.strip() == str(tmp_path / "site" / "index.html")
    assert '<table id="leaderboard">' in page and "http://" not in page and "https://" not in page
    assert page.count('src="data:image/png;base64,') == 1  # the curves (the heatmap is a table)
    assert '<meta name="viewport"' in page and '<table class="heat">' in page


def test_report_from_the_store_alone_is_the_board_of_its_files(setup, tmp_path, capsys, monkeypatch):
    """No --matrix, anywhere: every run the store holds, each with the file it came from; an
    attack search's trial (a run from a file with a [search] table) stays out."""
    from robustbn.cli import main

    db, files = setup
    assert main(["report", "--db", str(db), "--format", "json", *[a for f in files for a in ("--matrix", f)]]) == 0
    with_files = json.loads(capsys.readouterr().out)
    copy = tmp_path / "s.sqlite"
    shutil.copy(db, copy)
    search = tmp_path / "search_mine.toml"
    search.write_text("[search]\ntrials = 1\n")
    with Store(copy, readonly=True) as store:
        source = {r["hash"]: r["source"] for r in read_rows(store.rows(), files)}
    with sqlite3.connect(copy) as con:  # as `robustbn run FILE` and `attack-search FILE` record them
        for (h,) in con.execute("SELECT hash FROM runs").fetchall():
            con.execute("UPDATE runs SET source = ? WHERE hash = ?", (source.get(h, str(search)), h))
    assert set(source) != {h for (h,) in sqlite3.connect(copy).execute("SELECT hash FROM runs")}  # a trial is there
    monkeypatch.chdir(tmp_path)  # no scenarios/ here
    assert main(["report", "--db", str(copy), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == with_files


@pytest.mark.parametrize("args, message", [
    ([], "nothing to do: give --out DIR"),
    (["--format", "json", "--matrix", "missing.toml"], "--matrix missing.toml: no such scenario file"),
    (["--format", "json", "--gamma", "0.5"], "no finished attacked runs"),
    (["--format", "json", "--gamma", "0.5"], "(it has gamma 0: --gamma G)"),
    (["--format", "json", "--gamma", "nan"], "--gamma nan: a finite number"),
])
def test_report_command_bad_input_is_one_line(setup, args, message, capsys):
    from robustbn.cli import main

    db, files = setup
    matrices = [] if "--matrix" in args or not args else [a for f in files for a in ("--matrix", f)]
    assert main(["report", "--db", str(db), *args, *matrices]) == 2
    err = capsys.readouterr().err
    assert err.startswith("robustbn report: ") and message in err and len(err.strip().splitlines()) == 1


def test_fewer_than_five_paired_seeds_give_no_verdict(setup):
    """The same store on seeds 0-3 only: the intervals still exclude 0 for naive BN, but 4 pairs
    are no verdict on the leaderboard."""
    db, files = setup
    with Store(db, readonly=True) as store:
        rows = [r for r in read_rows(store.rows(), files) if r["seed"] in range(4)]
    board = leaderboard(rows)
    assert {r["verdict"] for r in board.rows if not r["server_data"]} == {"4 seeds, no verdict"}
    v = ACC["naive", "nnm+median", "alie-grad"][:4]
    low, high = stats.t.interval(0.95, 3, loc=sum(v) / 4, scale=stats.sem(v))
    assert board.lines[0] == (f"with naive BN, root-free: the highest worst case is mean on the gradients, nnm+median on the mean "
                              f"and variance ({100 * sum(v) / 4:.1f}% [{100 * low:.1f}, {100 * high:.1f}], 4 seeds); "
                              f"4 seeds, no verdict")


def test_the_robustness_section_maps_the_picks_at_their_tuned_values(tmp_path):
    """robustness_html: a table per protocol and threat model, a cell per (f, gamma) naming the
    paired rule's pick with its tuned lr and worst case; a figure per sweep with several points;
    without curves, the sentence it is given."""
    import re

    from robustbn.labels import compact_defense
    from robustbn.report import robustness_html
    from robustbn.worst import defense_map
    from test_worst_case import ATTACKS, DEFENSES, add

    store = Store(tmp_path / "c.sqlite")
    for seed in range(5):
        for d, defense in enumerate(DEFENSES):
            for gamma, lr in ((0.0, 0.1), (1.0, 0.01)):
                add(store, 0.2 + 0.3 * d + 0.2 * gamma + 0.01 * ((seed + d) % 3), norm="fbn", f=3, gamma=gamma,
                    lr=lr, seed=seed, **DEFENSES[defense], **ATTACKS["sf-mean"])
    rows = store.rows()
    store.close()
    page = robustness_html(rows, ("lr",), {"gamma": ("f", 3)})
    (table,) = re.findall(r'<table class="map">.*?</table>', page)
    assert "FBN, root-free" in table
    points = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", table)
    expect = {c["gamma"]: c for c in defense_map(rows, "gamma", "f", ("lr",))}
    assert [(gamma, f) for gamma, f, *_ in points] == [("0", "3"), ("1", "3")]  # a row per point that ran
    for (_, _, head, cell), gamma in zip(points, (0.0, 1.0)):
        (p,) = expect[gamma]["picks"]
        assert head == "<b>use</b>" and (
            f"{compact_defense(p['defense'])} {100 * p['worst_acc']:.1f} [{100 * p['ci_low']:.1f}, "
            f"{100 * p['ci_high']:.1f}] (5 seeds; lr {p['lr']})") in cell
        assert "(grad)" in cell and "on the gradients" not in cell  # short enough for a phone
        nxt = expect[gamma]["runner_up"]  # and the margin over the closest other defense, paired
        assert f"<div>next, lower by {100 * nxt['gap']:.1f} [{100 * nxt['gap_low']:.1f}, " in cell
    assert page.count('alt="Worst case along gamma at f = 3') == 1
    # a note after a pick's tuned values (whether its attack search is confirmed), that pick's only
    (p,) = expect[1.0]["picks"]
    noted = robustness_html(rows, ("lr",), notes={("fbn", None, 1.0, 3, p["defense"]): ", not searched yet"})
    # in the defense map, and in the protocol table where it is FBN's top defense
    assert re.findall(r"\(5 seeds; lr [0-9.]+, not searched yet[);]", noted) == \
        [f"(5 seeds; lr {p['lr']}, not searched yet)", f"(5 seeds; lr {p['lr']}, not searched yet;"]
    assert "; worst: SF (BN mean))" in noted  # the protocol's pick names its worst attack and what it touched
    (protocols,) = re.findall(r'<table class="map protocols">.*?</table>', page)
    assert re.findall(r"<td><b>(.*?)</b></td>", protocols) == ["only FBN run", "only FBN run"]  # nothing else planned
    assert robustness_html([], pending="Not run yet.") == "<p>Not run yet.</p>"
    assert robustness_html([], pending="Run `robustbn tune a<b.toml`.") == \
        "<p>Run <code>robustbn tune a&lt;b.toml</code>.</p>"


def test_the_robustness_section_names_the_protocol_to_use_at_each_point(tmp_path):
    """The protocol table of robustness_html: FBN above naive BN on every seed at gamma 0 ("use
    FBN", naive BN lower by the paired gap), and a planned protocol with no run named."""
    import re

    from robustbn.report import robustness_html
    from test_worst_case import ATTACKS, DEFENSES, add

    with Store(tmp_path / "p.sqlite") as store:
        for seed in range(5):
            for norm, level in (("naive", 0.3), ("fbn", 0.5)):
                for gamma in (0.0, 1.0):
                    add(store, level + 0.01 * seed + 0.2 * gamma, norm=norm, f=3, gamma=gamma, lr=0.05, seed=seed,
                        **DEFENSES["mean"], **ATTACKS["sf-mean"])
        rows = store.rows()
    page = robustness_html(rows, ("lr",), {"gamma": ("f", 3)})
    (protocols,) = re.findall(r'<table class="map protocols">.*?</table>', page)
    assert "<caption>Which BN protocol, root-free, each defense at its tuned lr: " in protocols
    assert page.startswith("<p>The protocols naive BN, FBN along heterogeneity (gamma) and the number of Byzantine "
                           "clients (f). Each defense runs at each point at its own tuned lr")
    assert page.count('alt="Which BN protocol along gamma at f = 3') == 1  # and their figure
    (row,) = re.findall(r"<tr><td>0</td><td>3</td><td><b>(.*?)</b></td><td>(.*?)</td></tr>", protocols)
    assert row[0] == "use FBN"
    assert row[1].startswith("<div><b>FBN</b> mean 52.0 [") and \
        "<div>lower by 20.0 [20.0, 20.0] (5 pairs): <b>naive BN</b> mean 32.0 [" in row[1]
    planned = robustness_html(rows, ("lr",), planned=["fbn", "naive", "fixbn"])
    assert "<b>FBN above (of those finished; FixBN not yet)</b>" in planned
    # the leader unsearched holds the verdict back; naive BN's, already lower, does not
    assert "<b>use FBN; provisional: no attack search confirmed against FBN</b>" in \
        robustness_html(rows, ("lr",), searched=lambda key: key[0] == "naive")
    assert "<b>use FBN</b>" in robustness_html(rows, ("lr",), searched=lambda key: key[0] == "fbn")


def test_a_tie_is_named_while_another_row_lacks_seeds():
    """The highest row's own verdict is "1 seed, no verdict" (one row has a single seed), yet the
    rows paired with it on enough seeds are tied: the pick names the tied set, picks none, and
    names the row not yet compared (it never says "use")."""
    from robustbn.report import pick

    row = lambda d, acc, verdict, seeds=5: {"defense": d, "worst_acc": acc, "ci_low": acc - 0.1,
                                            "ci_high": acc + 0.1, "seeds": seeds, "verdict": verdict}
    text = pick([row("arc", 0.48, "1 seed, no verdict"), row("cc", 0.34, "tied for best"),
                 row("mean", 0.10, "1 seed, no verdict", seeds=1), row("dnc", 0.10, "worse")])
    assert text.startswith("no single pick, 2 tied for best: arc (") and "cc (" in text
    assert "not yet compared: mean: 1 seed, no verdict" in text and "use " not in text and "dnc" not in text


def test_rows_of_other_settings_are_rows_of_their_own_named_by_what_differs(tmp_path):
    """A store of two settings (n = 10 and n = 12): each defense is a row per setting, which
    says its n, never one row whose numbers mix them (nor two rows of one name)."""
    store = Store(tmp_path / "s.sqlite")
    for n, acc in ((10, 0.3), (12, 0.6)):
        for seed in range(5):
            run(store, acc + 0.01 * seed, n=n, seed=seed, **DEFENSES["mean"], **CATALOGUE["sf-mean"])
    board = leaderboard(store.rows())
    store.close()
    got = {r["defense"]: round(r["worst_acc"], 6) for r in board.rows}
    assert got == {"mean (n=10)": 0.32, "mean (n=12)": 0.62}


def test_a_board_of_several_f_names_each_row_s_f_and_picks_within_each(tmp_path):
    """f = 1 and f = 2 in one store: each row says its f, and each pick compares the defenses of
    one f only (a tie across two f values would compare settings, not defenses)."""
    store = Store(tmp_path / "s.sqlite")
    for f, accs in ((1, {"mean": 0.7, "trmean": 0.3}), (2, {"mean": 0.2, "trmean": 0.5})):
        for name, acc in accs.items():
            for seed in range(5):
                run(store, acc + 0.01 * seed, f=f, seed=seed, **DEFENSES[name], **CATALOGUE["sf-mean"])
    board = leaderboard(store.rows())
    store.close()
    trmean = "mean on the gradients, trmean on the mean and variance"
    assert {r["defense"] for r in board.rows} == {"mean (f=1)", f"{trmean} (f=1)", "mean (f=2)", f"{trmean} (f=2)"}
    root_free = {r["setting"]: r["text"] for r in board.recommendations if r["threat"] == "root-free"}
    assert set(root_free) == {"f=1", "f=2"}
    assert root_free["f=1"].startswith("with FBN at f=1, root-free: use mean (")
    assert root_free["f=2"].startswith(f"with FBN at f=2, root-free: use {trmean} (")
    assert "None" not in " ".join(board.lines)


def test_the_setup_names_only_the_messages_the_runs_attack_and_the_server_data_they_use(tmp_path):
    """The page's setup box is written from the rows: a board whose attacks touch the gradients
    only says so (not the BN statistics), and says nothing of trusted server data where no
    defense used any; a board with BN attacks and an FLTrust row names both."""
    import html

    from robustbn.report import leaderboard, setup_html
    from test_worst_case import ATTACKS, DEFENSES, add

    def box(*attacks, trusted=False, norm="fbn"):
        store = Store(tmp_path / f"{'_'.join(attacks)}_{trusted}_{norm}.sqlite")
        for seed in range(2):
            for defense in DEFENSES:
                for attack in attacks:
                    add(store, 0.3 + 0.1 * seed, norm=norm, f=3, seed=seed, **DEFENSES[defense], **ATTACKS[attack])
            if trusted:
                add(store, 0.5 + 0.1 * seed, norm="fbn", f=3, seed=seed, grad_agg="fltrust", root_size=50,
                    grad_attack="alie")
        rows = store.rows()
        store.close()
        return setup_html(leaderboard(rows))

    grad_only = box("alie-grad")
    # gamma = 0 cuts the label-sorted data among the n - f honest clients: 7 of them, not one class each
    assert ("gamma = 0.0: each honest client holds a label-sorted slice of the training set, about 1.4 classes' "
            "worth of data (10 classes over 7 honest clients)") in html.unescape(grad_only)
    assert "the messages these runs attack: the gradients (worker momentum);" in grad_only
    assert "Trusted server data" not in grad_only
    both = box("alie-grad", "sf-mean", trusted=True)
    assert "attack: the gradients (worker momentum) and the BN running means;" in both
    assert "Trusted server data" in both and "root set of 50" in both
    # a protocol whose statistics stop at a switch round: a BN attack acts before it only, and the box says so
    phased = "FixBN sends statistics in the first phase only (up to the switch round)"
    assert phased not in both and phased in box("sf-mean", norm="fixbn")


def test_a_tied_map_cell_gives_each_tied_pick_its_paired_gap_and_every_pick_its_clean_interval(tmp_path):
    """In a tied cell every pick after the first carries its paired gap to the first (an interval
    holding 0), on the page as in the fields; a pick's clean accuracy comes with its interval and
    seeds (pick_tail), and one seed says it has no interval."""
    import re

    from robustbn.report import pick_tail, robustness_html
    from robustbn.worst import TIED, defense_map
    from test_worst_case import ATTACKS, DEFENSES, add

    noise = [0.00, 0.03, -0.02, 0.01, -0.01]
    store = Store(tmp_path / "t.sqlite")
    for seed in range(5):
        for d, defense in enumerate(DEFENSES):
            add(store, 0.6 + noise[(seed + d) % 5], norm="fbn", f=3, gamma=1.0, lr=0.1, seed=seed,
                **DEFENSES[defense], **ATTACKS["sf-mean"])
            add(store, 0.8 + 0.01 * seed, norm="fbn", f=3, gamma=1.0, lr=0.1, seed=seed, **DEFENSES[defense])
    rows = store.rows()
    store.close()
    (cell,) = defense_map(rows, "gamma", "f", ("lr",))
    first, second = cell["picks"]
    assert cell["verdict"] == TIED and second["gap_pairs"] == 5 and second["gap_low"] < 0 < second["gap_high"]
    assert second["gap"] == pytest.approx(first["worst_acc"] - second["worst_acc"])
    page = robustness_html(rows, ("lr",))
    (table,) = re.findall(r'<table class="map">.*?</table>', page)
    assert table.count("<div>tied, gap ") == 1
    assert f"<div>tied, gap {100 * second['gap']:.1f} [{100 * second['gap_low']:.1f}, " in table
    assert first["no_attack_seeds"] == 5 and first["no_attack_low"] < first["no_attack_acc"] < first["no_attack_high"]
    assert pick_tail(first) == (f"; clean {100 * first['no_attack_acc']:.1f} [{100 * first['no_attack_low']:.1f}, "
                                f"{100 * first['no_attack_high']:.1f}] (5 seeds); worst: SF (BN mean)")
    assert pick_tail({"no_attack_acc": 0.764, "no_attack_low": None, "no_attack_high": None, "no_attack_seeds": 1}) \
        == "; clean 76.4 (1 seed, no interval)"
