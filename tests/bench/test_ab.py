"""bench ab: schedule, disjoint seed ranges, the verdict against the A-vs-A spread, and a CPU
smoke run on the tiny preset."""

import json

from mambaserve.bench.ab import ABConfig, analyze, format_report, range_seed, run_ab, schedule


def test_schedule_interleaves_and_balances():
    s = schedule(3)
    assert s == [list("ABBA"), list("BAAB"), list("ABBA")]
    assert all(r.count("A") == 2 and r.count("B") == 2 for r in s)


def test_seed_ranges_are_disjoint():
    n = 1000
    starts = [range_seed(7, k, p, w) for k in range(5) for p in range(4) for w in (False, True)]
    ranges = [set(range(s, s + n)) for s in starts]
    assert len(starts) == len(set(starts))
    for i, a in enumerate(ranges):
        for b in ranges[i + 1:]:
            assert not a & b


def rows(values):
    """values: per round, the four measurements in schedule order."""
    out = []
    for k, (order, vals) in enumerate(zip(schedule(len(values)), values)):
        out += [{"round": k, "position": p, "arm": a, "tokens_per_s": v}
                for p, (a, v) in enumerate(zip(order, vals))]
    return out


def test_clear_difference_is_conclusive():
    res = analyze(rows([[100, 120, 121, 101], [119, 100, 99, 120], [100, 121, 120, 100]]))
    assert res["conclusive"] and res["verdict"].startswith("B faster by")
    assert abs(res["relative_diff"] - 0.2) < 0.01
    assert res["A_vs_A_spread"] < 0.02
    text = format_report(res)
    assert "median A" in text and "A-vs-A spread" in text


def test_difference_within_drift_is_inconclusive():
    # A varies by 10 % against itself; B is 5 % faster: noise
    res = analyze(rows([[100, 105, 106, 110], [110, 100, 110, 111], [100, 105, 104, 110]]))
    assert not res["conclusive"] and res["verdict"] == "inconclusive"
    assert "inconclusive" in format_report(res)


def test_rounds_disagreeing_in_sign_are_inconclusive():
    res = analyze(rows([[100, 130, 130, 100], [95, 100, 100, 95], [100, 130, 130, 100]]))
    assert res["A_vs_A_spread"] == 0 and not res["conclusive"]


def test_ab_tiny_on_cpu(tmp_path, capsys):
    logs = []
    res = run_ab(ABConfig(preset="tiny", a={"enforce_eager": True}, b={"enforce_eager": False},
                          rounds=2, num_prompts=3, input_len=12, output_len=4, warmup_prompts=1,
                          dtype="float32"), log=logs.append)
    assert len(res["rows"]) == 8 and [r["arm"] for r in res["rows"]] == list("ABBABAAB")
    assert all(r["tokens_per_s"] > 0 for r in res["rows"])
    assert res["verdict"] in ("inconclusive",) or res["verdict"].startswith("B ")
    from mambaserve.cli import main

    out = tmp_path / "ab.json"
    assert main(["bench", "ab", "--preset", "tiny", "--rounds", "1", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "2", "--warmup-prompts", "0",
                 "--device", "cpu", "--dtype", "float32", "--b", "mamba_ssm_dtype=float32",
                 "--out", str(out)]) == 0
    assert "verdict:" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["rows"]) == 4
