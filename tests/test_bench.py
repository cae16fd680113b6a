"""hsd bench: schema and sane values on a tiny model, detection of non-identical outputs, suite errors."""
import json

import pytest

from hsd_jax import load_drafter
from hsd_jax.bench import BenchError, format_table, make_runner, run_bench
from hsd_jax.prompts import SuiteError, load_suite
from tests.helpers import run_cli, tiny_target

KEYS = {"tau", "tokens_per_s", "speedup_vs_ar", "identical_to_ar", "drafter_forwards_per_token", "accepted_hist"}


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=64)


def test_bench_schema_and_values(tiny):
    prompts = [[3, 9, 27, 17], [40, 2, 2, 8, 13, 1]]
    tree = dict(tree_nodes=6, tree_depth=4, tree_top_k=2)   # depth 4: refresh reuses the depth-3+ states
    runners = {"ar": make_runner(tiny, "ar", max_new_tokens=16)}
    for name in ("sd", "eagle", "hsd-refresh", "hsd-noreuse"):
        kind = name.split("-")[0]
        runners[name] = make_runner(tiny, name, load_drafter(kind, target=tiny, random_init=True),
                                    options=dict(tree, gamma=3), max_new_tokens=16)
    out = run_bench(runners, prompts, batch_size=1, progress=False)
    assert set(out) == set(runners)
    for name, m in out.items():
        assert KEYS <= set(m)
        assert m["identical_to_ar"] is True
        assert m["tokens_per_s"] > 0 and m["speedup_vs_ar"] > 0 and m["new_tokens"] == 32
        assert sum(m["accepted_hist"]) == m["rounds"]
    assert out["ar"]["tau"] == 1.0 and out["ar"]["speedup_vs_ar"] == 1.0
    assert out["hsd-refresh"]["drafter_forwards_per_token"] < out["hsd-noreuse"]["drafter_forwards_per_token"]
    assert out["hsd-noreuse"]["options"]["reuse"] == "none"
    assert "| hsd-refresh |" in format_table(out)


def test_bench_detects_outputs_that_differ_from_ar(tiny):
    ar = make_runner(tiny, "ar", max_new_tokens=8)

    def wrong(ids):
        res = ar(ids)
        for r in res:
            r.token_ids = r.token_ids[:-1] + [(r.token_ids[-1] + 1) % 64]
        return res

    out = run_bench({"ar": ar, "broken": wrong}, [[1, 2, 3], [4, 5]], progress=False)
    assert out["ar"]["identical_to_ar"] is True and out["broken"]["identical_to_ar"] is False


def test_repeats_count_the_fastest_run_and_pruned_trees_verify_fewer_rows(tiny):
    ar = make_runner(tiny, "ar", max_new_tokens=8)
    calls = []

    def timed(ids):   # ar's tokens; the warm-up 9 s, then batch 0: 4 s and 1 s, batch 1: 1 s and 4 s
        res = ar(ids)
        calls.append(1)
        for r in res:
            r.stats["seconds"] = (9.0, 4.0, 1.0, 1.0, 4.0)[len(calls) - 1]
        return res

    tree = dict(tree_nodes=6, tree_depth=3, tree_top_k=2)
    hsd = load_drafter("hsd", target=tiny, random_init=True)
    runners = {"ar": ar, "timed": timed,
               "hsd": make_runner(tiny, "hsd", hsd, options=tree, max_new_tokens=8),
               "hsd~0.3": make_runner(tiny, "hsd~0.3", hsd, options=tree, max_new_tokens=8)}
    out = run_bench(runners, [[1, 2, 3], [4, 5]], progress=False, repeats=2)
    assert len(calls) == 1 + 2 * 2   # warm-up on the first batch, then 2 batches x 2 repeats
    assert out["timed"]["tokens_per_s"] == 8.0 and out["timed"]["identical_to_ar"] is True   # 1 s each: the fastest
    assert out["ar"]["verify_rows_per_round"] == 1.0 and out["hsd"]["verify_rows_per_round"] == 7.0
    assert out["hsd~0.3"]["identical_to_ar"] is True and out["hsd~0.3"]["options"]["min_draft_prob"] == 0.3
    assert out["hsd~0.3"]["verify_rows_per_round"] < 7.0
    with pytest.raises(BenchError, match="repeats >= 1"):
        run_bench(runners, [[1, 2]], repeats=0)
    for bad in ("sd~0.1", "hsd~1.5", "hsd~x"):
        with pytest.raises(BenchError, match="METHOD~P"):
            make_runner(tiny, bad)


def test_spec_bench_categories_are_suites():
    summ = load_suite("spec_bench:summarization")
    assert len(summ) == 80 and all(p.startswith("Summarize:") for p in summ)
    assert len(load_suite("spec_bench:rag", 3)) == 3 and len(load_suite("spec_bench")) == 480
    with pytest.raises(SuiteError, match="no prompts in category 'poetry'"):
        load_suite("spec_bench:poetry")


def test_suite_with_bad_line_is_rejected_with_line_number(tmp_path):
    p = tmp_path / "suite.jsonl"
    p.write_text('{"turns": ["Explain RoPE."]}\n{"prompt": "What is JAX?"}\n{"turns": []}\n')
    with pytest.raises(SuiteError, match=r"suite.jsonl:3: expected a non-empty"):
        load_suite(str(p))
    p.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(SuiteError, match=r"suite.jsonl:2: not valid JSON"):
        load_suite(str(p))
    assert load_suite("mt_bench", 3)[0].startswith("Compose an engaging travel blog post")
    r = run_cli("bench", "--suite", str(p), "--methods", "ar")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error:") and ":2:" in r.stderr
    r = run_cli("bench", "--methods", "ar,medusa")
    assert r.returncode == 2 and "unknown method 'medusa'" in r.stderr


def test_bench_cli_writes_json_and_plot(tmp_path):
    out, fig = tmp_path / "b.json", tmp_path / "b.png"
    r = run_cli("bench", "--suite", "gsm8k", "--num-prompts", "1",
                        "--methods", "ar,hsd", "--random-drafters", "--max-new-tokens", "6", "--json", str(out),
                        "--plot", str(fig), "--tree-nodes", "4", "--tree-depth", "2", "--top-k", "2")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["methods"]["hsd"]["identical_to_ar"] is True and res["options"]["tree_nodes"] == 4
    from hsd_jax import cpu_kernels

    assert res["machine"]["cpu_kernel"] is cpu_kernels.enabled()     # results say whether the CPU kernel ran
    assert fig.stat().st_size > 10_000


def test_hybrid_method_names_carry_lookup_slots():
    from hsd_jax.bench import BenchError, method_spec

    assert method_spec("hsd+lookup") == ("hsd", {"lookup_slots": 4})
    assert method_spec("hsd-chain+lookup6") == ("hsd", {"reuse": "chain", "lookup_slots": 6})
    assert method_spec("eagle+lookup2") == ("eagle", {"lookup_slots": 2})
    assert method_spec("hsd+lookup6/0") == ("hsd", {"lookup_slots": 6, "lookup_min_match": 0})
    assert method_spec("hsd+lookup/3") == ("hsd", {"lookup_slots": 4, "lookup_min_match": 3})
    for bad in ("sd+lookup", "lookup+lookup", "hsd+lookupx", "ar+lookup", "hsd+lookup4/", "hsd+lookup4/x"):
        with pytest.raises(BenchError, match="tree method"):
            method_spec(bad)
    tgt = tiny_target(vocab=64)
    run = make_runner(tgt, "hsd+lookup2", load_drafter("hsd", target=tgt, random_init=True),
                      options=dict(tree_nodes=4, tree_depth=2, tree_top_k=2, gamma=3, lookup_slots=7))
    assert run.options == dict(tree_nodes=4, tree_depth=2, tree_top_k=2, lookup_slots=2)   # the name wins
    plain = make_runner(tgt, "lookup", None, options=dict(tree_nodes=4, gamma=3, lookup_slots=7))
    assert plain.options == dict(gamma=3)                                     # a chain method reads gamma only
