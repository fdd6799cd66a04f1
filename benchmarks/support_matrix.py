"""Generate the support matrix of docs/support.md: every check on every family's tiny model.

    python benchmarks/support_matrix.py            # print the table
    python benchmarks/support_matrix.py --write    # also replace it in docs/support.md
    python benchmarks/support_matrix.py --all --write [--timeout 300] [--jobs 2] [--only TYPE,...] [--checks C,...]
        # every model type of transformers' causal-LM, seq2seq, masked-LM and image-text-to-text mappings:
        # a tiny model from a small config (posdiag.testing.multimodal.small_config), every check, one
        # subprocess per type with a time limit; results accumulate in benchmarks/sweep.jsonl (resumable:
        # types already there are not run again; --rerun --only TYPE,... runs those again, replacing their rows)
        # and the sweep table of docs/support.md is rebuilt from it; --rerun --checks serving,... runs only those
        # checks and replaces their verdicts in each row (a row of another transformers release is swept whole)

Rows are the families of posdiag.testing.zoo at transformers' default init; each cell is the check's
status on the healthy model. The last column is the shuffle verdict once positions are removed
(posdiag.testing.zoo.remove_positions) — the planted bug the headline check must catch. The same
expectations are asserted by the test suite; this script only tabulates them.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

SYMBOL = {"pass": "PASS", "fail": "**FAIL**", "warn": "WARN", "skip": "skip", "n/a": "n/a", "error": "**ERROR**"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--all", action="store_true", help="sweep every model type of the auto mappings")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model type (--all)")
    parser.add_argument("--only", default="", help="comma-separated model types (--all)")
    parser.add_argument("--rerun", action="store_true", help="sweep the --only types again, replacing their rows")
    parser.add_argument("--jobs", type=int, default=1, help="model types swept at once (--all; one core each)")
    parser.add_argument("--checks", default="", help="comma-separated checks (--all): only these run on each type")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one type, print JSON
    args = parser.parse_args()
    if args.one or args.all:
        import sweep  # benchmarks/sweep.py, next to this script

        names = [n for n in args.checks.split(",") if n] or None
        if args.one:
            sweep.run_one(args.one, names)
        else:
            sweep.run_all(args.timeout, [t for t in args.only.split(",") if t], args.write, args.rerun, args.jobs,
                          names)
        return

    import torch
    import transformers

    from posdiag import checks
    from posdiag.api import run_checks
    from posdiag.model.loading import from_module
    from posdiag.testing import zoo

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(2)
    names = [n for n in checks.available() if n != "load"]  # load needs checkpoint files
    lines = ["| family | kind | positions | " + " | ".join(names) + " | shuffle, positions removed |",
             "|---" * (len(names) + 4) + "|"]
    print("\n".join(lines), flush=True)  # the header first: benchmarks/compat.py reads the rows by it
    for family in zoo.FAMILIES:
        report = run_checks(from_module(zoo.tiny_model(family), name=family), names)
        broken = zoo.tiny_model(family, init="strong")
        zoo.remove_positions(broken, family)
        removed = run_checks(from_module(broken), ["shuffle"]).check("shuffle").status.value
        cells = [SYMBOL[report.check(n).status.value] for n in names]
        lines.append(f"| {family} | {zoo.model_kind(family)} | {zoo.position_kind(family)} | "
                     + " | ".join(cells) + f" | {SYMBOL[removed]} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.write:
        page = Path(__file__).resolve().parent.parent / "docs" / "support.md"
        text = page.read_text()
        text = re.sub(r"<!-- matrix:start -->.*?<!-- matrix:end -->",
                      f"<!-- matrix:start -->\n{table}\n<!-- matrix:end -->", text, flags=re.S)
        page.write_text(text)


if __name__ == "__main__":
    main()
