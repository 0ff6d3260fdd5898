"""mambaserve.tools.eval: the QA scorer on canned outputs, and `mambaserve eval qa|perplexity`
end to end on the tiny random checkpoint (perplexity checked against HF)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mambaserve.cli import main
from mambaserve.tools.eval import (
    extract_answer,
    load_jsonl,
    numbers_equal,
    reference_answer,
    score_qa,
    split_windows,
)

QA = Path(__file__).parent.parent / "fixtures" / "qa_small.jsonl"


def test_extraction_and_normalization():
    assert extract_answer("so 3 + 4 = 7.\n#### 7") == "7"
    assert extract_answer("#### 45\nand later 90") == "45"  # after #### wins over the last number
    assert extract_answer("It costs $1,234.50.") == "1234.50"
    assert extract_answer("first 3, then 4, finally -12.") == "-12"
    assert extract_answer("#### none here, but 5 before") == "5"
    assert extract_answer("no number at all") is None
    assert extract_answer("") is None
    assert numbers_equal("1234.50", "1,234.5")
    assert numbers_equal("$1,234.50", "1234.5")
    assert numbers_equal("42.", "42")
    assert numbers_equal("2.50", "5/2")
    assert not numbers_equal("45", "90")
    assert reference_answer("x\n#### 1,234.50") == "1234.50"
    with pytest.raises(ValueError):
        reference_answer("no marker 5")


def test_score_qa_canned_outputs():
    items = load_jsonl(QA)[2:]  # the first two are the shots of the end-to-end test
    assert [reference_answer(i["answer"]) for i in items] == ["36", "1234.50", "90", "2.5", "16"]
    canned = [
        "She keeps 56 - 20 = 36 pencils.\n#### 36",    # correct, after ####
        " He has 1500 - 265.50 = $1,234.5 left.",        # correct, last number, $ and , stripped
        " He sells 45 sheep.\n#### 45\nThen 90.",        # wrong: #### beats the last number
        " Each piece is 2.5 meters.",                    # correct, last number, trailing "."
        " She has many apples.",                         # invalid: no number
    ]
    res = score_qa(items, canned)
    assert (res["num"], res["correct"], res["invalid"]) == (5, 3, 1)
    assert res["accuracy"] == pytest.approx(0.6)
    assert res["invalid_rate"] == pytest.approx(0.2)
    assert [p["correct"] for p in res["per_item"]] == [True, True, False, True, False]
    assert [p["invalid"] for p in res["per_item"]] == [False, False, False, False, True]
    assert [p["extracted"] for p in res["per_item"]] == ["36", "1234.5", "45", "2.5", None]
    assert res["per_item"][1]["prediction"] == canned[1]
    with pytest.raises(ValueError):
        score_qa(items, canned[:2])


def test_eval_qa_cli_tiny(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "qa.json"
    rc = main(["eval", "qa", str(QA), "--model", str(tiny_ckpt), "--shots", "2", "--limit", "3",
               "--max-tokens", "12", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    items = load_jsonl(QA)
    assert res["num"] == 3 and len(res["per_item"]) == 3 and res["shots"] == 2
    assert [p["question"] for p in res["per_item"]] == [i["question"] for i in items[2:5]]
    assert res["correct"] == sum(p["correct"] for p in res["per_item"])
    assert res["invalid"] == sum(p["invalid"] for p in res["per_item"])
    assert res["accuracy"] == pytest.approx(res["correct"] / res["num"])
    assert res["invalid_rate"] == pytest.approx(res["invalid"] / res["num"])
    for p in res["per_item"]:
        assert p["extracted"] == extract_answer(p["prediction"])
        assert p["invalid"] == (p["extracted"] is None)
        assert "Question:" not in p["prediction"]  # the stop string ends generation


def test_split_windows():
    assert split_windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]  # a 1-token tail is dropped
    assert split_windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError):
        split_windows([1, 2], 1)


def test_eval_perplexity_cli_tiny_matches_hf(tiny_ckpt, hf_model, tmp_path):
    from mambaserve.engine.tokenizer import Tokenizer

    text = ("Sing, O goddess, the anger of Achilles son of Peleus, that brought countless ills "
            "upon the Achaeans. Many a brave soul did it send hurrying down to Hades.\n") * 2
    f = tmp_path / "text.txt"
    f.write_text(text)
    out = tmp_path / "ppl.json"
    rc = main(["eval", "perplexity", str(f), "--model", str(tiny_ckpt), "--window", "64",
               "--max-tokens", "300", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())

    ids = Tokenizer(tiny_ckpt).encode(text)[:300]
    windows = split_windows(ids, 64)
    assert len(windows) == 5 and len(windows[-1]) == 300 - 4 * 64
    assert res["windows"] == 5 and res["tokens_scored"] == 300 - 5
    nll = 0.0
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w])
            logp = torch.log_softmax(hf_model(input_ids=x).logits.float(), dim=-1)
            nll -= logp[0, :-1].gather(-1, x[0, 1:, None]).sum().item()
    assert res["nll"] == pytest.approx(nll, rel=1e-3)
    assert res["loss"] == pytest.approx(res["nll"] / res["tokens_scored"], rel=1e-12)
    assert res["perplexity"] == pytest.approx(math.exp(nll / res["tokens_scored"]), rel=1e-3)
