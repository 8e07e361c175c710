"""searchr1-report: what the agent did, as one HTML page that opens offline.

    searchr1-report runs/offline                       # a training run's output_dir -> runs/offline/report.html
    searchr1-report runs/eval                          # a searchr1-eval output_dir -> runs/eval/report.html
    searchr1-report runs/warm runs/trained             # two folders compared -> runs/warm/report_vs_trained.html
    searchr1-report runs/eval -o /tmp/eval.html

The page holds the run's curves (EM per data source, reward, searches and turns per rollout, statuses, calls the
engine closed, what the search policy learned) or the evaluation's bars per method x checkpoint, and every trace:
per question the turns, each query, the passages' titles with the golden answer marked where it appears, the answer,
EM, F1 and status, with filters. With one folder it compares the folder's first and last trace sets (a run's first
and last validation, an evaluation's first and last checkpoint); with two, the last set of each: the questions whose
outcome flipped side by side, and how searches and statuses changed. Training and ``searchr1-eval`` write
``report.html`` themselves at the end (``--trace_report false`` skips it).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    from searchr1_trl.report.page import write_report

    parser = argparse.ArgumentParser(prog="searchr1-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", metavar="folder",
                        help="A training run's output_dir or a searchr1-eval output_dir; a second one to compare.")
    parser.add_argument("-o", "--output", help="The HTML file to write (default: report.html in the folder, "
                                               "report_vs_<second>.html with two).")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.folders, args.output)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(f"report: {path} (open it in a browser; it needs no network)")


if __name__ == "__main__":
    main()
