"""Golden outputs (``jobs/golden.py``): the default model's greedy tokens and per-sample log-perplexities
on a fixed prompt set (CPU, float32) equal the checked-in file; a change that moves them fails with a
diff naming the sample. Regenerate on purpose with ``python jobs/golden.py --write``."""

import copy
import json

from rayinfer.jobs import golden


def test_golden_outputs_are_unchanged(smollm2):
    want = json.loads(golden.GOLDEN.read_text())
    assert want["max_tokens"] == golden.MAX_TOKENS and len(want["samples"]) == len(golden.CHATS) + len(golden.RAW)
    problems = golden.compare(want["samples"], golden.run(smollm2.model, smollm2.tokenizer))
    assert not problems, "golden outputs moved:\n" + "\n".join(problems)


def test_the_comparison_names_what_moved():
    base = {"a": {"output_token_ids": [1, 2, 3], "text": "x", "top2_gaps": [0.5, 0.001, 0.5], "log_ppl": 0.5},
            "b": {"output_token_ids": [4, 5], "text": "y", "top2_gaps": [0.5, 0.5], "log_ppl": 0.7}}
    assert golden.compare(base, copy.deepcopy(base)) == []
    moved = copy.deepcopy(base)
    moved["b"]["output_token_ids"] = [4, 9]  # a wide gap: a regression
    moved["a"]["output_token_ids"] = [1, 7, 3]  # a near tie: tolerated
    assert [p.split(":")[0] for p in golden.compare(base, moved)] == ["b"]
    ppl = copy.deepcopy(base)
    ppl["a"]["log_ppl"] += 10 * golden.LOG_PPL_TOL
    [problem] = golden.compare(base, ppl)
    assert problem.startswith("a: log-perplexity")
    shorter = copy.deepcopy(base)
    del shorter["b"]
    assert golden.compare(base, shorter) == ["b: sample missing from this run"]
