"""Where a decode loop's time goes, op by op: XLA:CPU's per-thunk trace of one `generate` call.

Runs one method on one suite prompt (after a warm-up call), traces it with `jax.profiler`, and
sums each XLA op's self time (less the ops nested in it, as a while loop's body) per round (per
token for ar), and by how many calls an op made (30 x rounds: the layers in the loop; 1: set-up).
Each op is named by the JAX code that made it (the HLO metadata's op_name, from the compiled
program's text), so a row reads like "mlp/gate_proj/dot_general" instead of "ynn_fusion.4";
`--show-ops` prints the HLO of ops with no such name.

    python benchmarks/op_profile.py --method hsd --suite gsm8k --max-new-tokens 128     # the defaults
    python benchmarks/op_profile.py --method lookup --gamma 6 --suite spec_bench:summarization
    python benchmarks/op_profile.py --method hsd --tree 1,1,1 --lookup-slots 6 --lookup-min-match 0

(`HSD_CPU_KERNELS=0` profiles XLA's dots instead of `hsd_jax.cpu_kernels`.)
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

from hsd_jax import api, generate, load_drafter, load_target
from hsd_jax.prompts import load_suite


def op_sources(hlo_text: str) -> dict[tuple[str, str], str]:
    """(HLO module, instruction name) -> the op_name of its metadata (the JAX code path)."""
    module = re.match(r"HloModule ([\w.\-]+)", hlo_text).group(1)
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]+)\"", hlo_text, re.M):
        out[(module, m.group(1))] = re.sub(r"^jit\([\w]+\)/", "", m.group(2))
    return out


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """Total microseconds and calls per (HLO module, XLA op) in the newest trace under trace_dir."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, calls = collections.Counter(), collections.Counter()
    by_thread = collections.defaultdict(list)
    for e in events:
        a = e.get("args", {})
        op = (a.get("hlo_module"), a.get("hlo_op"))
        if e.get("ph") == "X" and op[1] and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], e["dur"], op))
    for evs in by_thread.values():              # self time: an op's duration less its nested ops'
        evs.sort(key=lambda x: (x[0], -x[1]))
        stack = []
        for ts, dur, op in evs:
            while stack and ts >= stack[-1][0] + stack[-1][1]:
                stack.pop()
            if stack:
                total[stack[-1][2]] -= dur
            total[op] += dur
            calls[op] += 1
            stack.append((ts, dur, op))
    return total, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ar")
    ap.add_argument("--suite", default="spec_bench:summarization")
    ap.add_argument("--prompt", type=int, default=0, help="index of the suite prompt")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-cache-len", type=int, default=2048)
    ap.add_argument("--tree", default="", help="nodes,depth,top-k for tree methods (default: the backend's preset)")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--lookup-slots", type=int, default=0)
    ap.add_argument("--lookup-min-match", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--show-ops", default="", help="comma-separated XLA op names whose HLO to print")
    args = ap.parse_args()

    target = load_target("smollm2-135m", max_cache_len=args.max_cache_len)
    ids = target.encode(load_suite(args.suite, args.prompt + 1)[args.prompt], chat=True)
    kw = dict(max_new_tokens=args.max_new_tokens)
    if args.method != "ar":
        kw.update(method=args.method, drafter=load_drafter(args.method, target=target))
        if args.method in ("sd", "lookup"):
            kw.update(gamma=args.gamma)
        elif args.tree:
            nodes, depth, top_k = map(int, args.tree.split(","))
            kw.update(tree_nodes=nodes, tree_depth=depth, tree_top_k=top_k, lookup_slots=args.lookup_slots,
                      lookup_min_match=args.lookup_min_match)
    generate(target, [ids], **kw)                                  # compile
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            r = generate(target, [ids], **kw)[0]
        total, calls = op_times(trace_dir)
    names = {}
    for exe in api._COMPILED.values():
        names.update(op_sources(exe.as_text()))
    rounds = r.stats.get("rounds") or r.stats["new_tokens"]
    print(f"{args.method} on {args.suite}[{args.prompt}] ({len(ids)} prompt tokens): {r.stats['new_tokens']} tokens "
          f"in {rounds} rounds, {r.stats['seconds'] * 1e3 / rounds:.1f} ms a round untraced-equivalent wall, "
          f"traced ops {sum(total.values()) / 1e3 / rounds:.1f} ms a round (prefill included)")
    groups = collections.Counter()
    for op, us in total.items():
        groups[calls[op]] += us
    print("by calls per op:", ", ".join(f"{c} calls: {us / 1e3 / rounds:.2f}" for c, us in groups.most_common(12)))
    show = set(filter(None, args.show_ops.split(",")))
    for exe in api._COMPILED.values():
        for line in exe.as_text().splitlines():
            m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
            if m and m.group(1) in show:
                print("HLO", line.strip()[:400])
    for op, us in total.most_common(args.top):
        print(f"{us / 1e3 / rounds:8.2f} ms/round {calls[op]:6d} calls  {op[1]:32s} {names.get(op, op[0])[-90:]}")


if __name__ == "__main__":
    main()
