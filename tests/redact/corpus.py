"""The redaction corpus (tests/redact/corpus, built by make_corpus.py) through the
core's streaming path: per-family recall on positives, the share of negatives left
intact. Used by tests/redact/test_corpus.py (targets) and tests/bench/run.py (table)."""

import json
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")


def load(name):
    with open(os.path.join(CORPUS, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def redact_texts(stockade, texts, chunk=0, policy=None, tool="cat", timeout=300):
    """Each text (str or bytes) through `stockade test` redaction, in reads of `chunk`
    bytes (0: one read); returns the outputs as bytes, in order."""
    with tempfile.TemporaryDirectory(prefix="stk-corpus-") as d:
        src, dst = os.path.join(d, "in"), os.path.join(d, "out")
        with open(src, "wb") as f:
            for t in texts:
                b = t.encode() if isinstance(t, str) else t
                f.write(b"%d\n" % len(b) + b)
        # the default policy also redacts the values of this environment's AWS_* and
        # *_TOKEN variables: leave them out, so the figures do not depend on the host
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("AWS_") or k.endswith("_TOKEN"))}
        env.setdefault("STOCKADE_PLUGIN_PATH", os.path.join(REPO_ROOT, "plugins"))
        env.update(REDACT_POLICY=policy or os.path.join(REPO_ROOT, "policies", "default.lua"),
                   REDACT_TOOL=tool, REDACT_CHUNK=str(chunk), REDACT_IN=src, REDACT_OUT=dst)
        subprocess.run([stockade, "test", os.path.join(HERE, "redact_cases.lua")], env=env, check=True,
                       cwd=REPO_ROOT, timeout=timeout, stdout=subprocess.DEVNULL)
        outs = []
        with open(dst, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            nl = data.index(b"\n", i)
            n = int(data[i:nl])
            outs.append(data[nl + 1:nl + 1 + n])
            i = nl + 1 + n
        return outs


# Held-out cases the default set leaves alone on purpose (counted as misses in the
# bench and the README; not held against the recall target by the tests):
# (part of the case) -> why.
DELIBERATE_MISSES = {
    "super secret private key here": "PEM markers around prose are not a key (the issue's precision "
                                     "finding: marker strings in source code and docs)",
    "https://username:password@yelp.com": "user:password@ is the placeholder every URL example uses",
    'std::string secret("': "a constructor call, not an assignment",
    'secrete.assign("': "a method call, not an assignment",
    'curl -u "d2LkV78zLx!t:"': "a user name without a password (curl prompts for none)",
}


def deliberate_miss(case):
    return any(k in case["text"] for k in DELIBERATE_MISSES)


def caught(case, out):
    """No secret, nor its last 8 characters, survives."""
    for s in case["secrets"]:
        b = s.encode()
        if b in out or (len(b) > 8 and b[-8:] in out):
            return False
    return True


# The two halves of the corpus: the cases the rules were written with (make_corpus.py)
# and the public rule sets' own test lists, imported afterwards (import_rulesets.py).
SETS = {"written": ("positives.jsonl", "negatives.jsonl"),
        "held-out": ("heldout-positives.jsonl", "heldout-negatives.jsonl")}


def evaluate(stockade, chunk=0):
    """{set: {"families": {family: (caught, total)}, "negatives": (intact, total),
    "negatives_by_family": {family: (intact, total)}, "look_alikes": (intact, total),
    "missed": [(case, out)], "damaged": [(case, out)]}} for each set of SETS. A
    negative of kind "look-alike" (a real-format key a rule set rejects only by value,
    or another family's secret) is counted apart, not as damage."""
    cases = []
    for name, (pf, nf) in SETS.items():
        cases += [(name, True, c) for c in load(pf)] + [(name, False, c) for c in load(nf)]
    outs = redact_texts(stockade, [c["text"] for _, _, c in cases], chunk)
    res = {name: {"families": {}, "negatives": (0, 0), "negatives_by_family": {},
                  "look_alikes": (0, 0), "missed": [], "damaged": []} for name in SETS}
    for (name, positive, c), out in zip(cases, outs):
        r = res[name]
        if positive:
            ok = caught(c, out)
            got, total = r["families"].get(c["family"], (0, 0))
            r["families"][c["family"]] = (got + ok, total + 1)
            if not ok:
                r["missed"].append((c, out))
            continue
        ok = out == c["text"].encode()
        if c.get("kind") == "look-alike":
            r["look_alikes"] = (r["look_alikes"][0] + ok, r["look_alikes"][1] + 1)
            continue
        r["negatives"] = (r["negatives"][0] + ok, r["negatives"][1] + 1)
        got, total = r["negatives_by_family"].get(c["family"], (0, 0))
        r["negatives_by_family"][c["family"]] = (got + ok, total + 1)
        if not ok:
            r["damaged"].append((c, out))
    return res


def _cell(got, total):
    if not total:
        return "—"
    return f"{got}/{total}" if got == total else f"{got}/{total} ({100.0 * got / total:.1f} %)"


def table(stockade, compare=None):
    """The per-family table of the README, as Markdown: recall on the written-with and
    held-out halves, negatives left intact; with `compare` (another plugins directory,
    e.g. an older commit's), its held-out figures beside."""
    now = evaluate(stockade, 0)
    old = None
    if compare:
        saved = os.environ.get("STOCKADE_PLUGIN_PATH")
        os.environ["STOCKADE_PLUGIN_PATH"] = compare
        try:
            old = evaluate(stockade, 0)
        finally:
            if saved is None:
                os.environ.pop("STOCKADE_PLUGIN_PATH")
            else:
                os.environ["STOCKADE_PLUGIN_PATH"] = saved
    cols = ["family", "written-with"] + (["held-out, compared"] if old else []) + [
        "held-out"] + (["held-out negatives intact, compared → now"] if old else ["held-out negatives intact"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    fams = sorted(set(now["written"]["families"]) | set(now["held-out"]["families"])
                  | set(now["held-out"]["negatives_by_family"]))
    totals = {}

    def add(key, v):
        g, t = totals.get(key, (0, 0))
        totals[key] = (g + v[0], t + v[1])

    for f in fams:
        w = now["written"]["families"].get(f, (0, 0))
        h = now["held-out"]["families"].get(f, (0, 0))
        n = now["held-out"]["negatives_by_family"].get(f, (0, 0))
        add("w", w)
        add("h", h)
        row = [f, _cell(*w)]
        if old:
            ho = old["held-out"]["families"].get(f, (0, 0))
            add("ho", ho)
            no = old["held-out"]["negatives_by_family"].get(f, (0, 0))
            row += [_cell(*ho), _cell(*h), "—" if not n[1] else f"{_cell(*no)} → {_cell(*n)}"]
        else:
            row += [_cell(*h), _cell(*n)]
        lines.append("| " + " | ".join(row) + " |")
    row = ["**all**", _cell(*totals["w"])]
    if old:
        row += [_cell(*totals["ho"]), _cell(*totals["h"]),
                f"{_cell(*old['held-out']['negatives'])} → {_cell(*now['held-out']['negatives'])}"]
    else:
        row += [_cell(*totals["h"]), _cell(*now["held-out"]["negatives"])]
    lines.append("| " + " | ".join(row) + " |")
    la = now["held-out"]["look_alikes"]
    lines.append("")
    lines.append(f"written-with negatives intact: {_cell(*now['written']['negatives'])}; "
                 f"held-out look-alikes left intact: {la[0]}/{la[1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    # /usr/bin/python3 tests/redact/corpus.py [--compare PLUGINS_DIR]
    import argparse
    ap = argparse.ArgumentParser(description="the redaction corpus's per-family table")
    ap.add_argument("--compare", help="another plugins directory to score the held-out half with")
    ap.add_argument("--stockade", default=os.path.join(REPO_ROOT, "stockade"))
    args = ap.parse_args()
    os.environ.setdefault("STOCKADE_PLUGIN_PATH", os.path.join(REPO_ROOT, "plugins"))
    print(table(args.stockade, args.compare))
