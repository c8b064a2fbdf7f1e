"""The chaos benchmark's rule for which 5xx a fault explains (the run itself is a benchmark:
`python -m fineslab.bench.chaos --json`, minutes of real runtimes; its figures are in
docs/serving.md)."""

from __future__ import annotations

from fineslab.bench.chaos import Ledger, build_parser


def test_a_502_or_504_is_expected_only_while_its_models_fault_lasts() -> None:
    ledger = Ledger()
    ledger.fault("a", "kill_server", 10.0)
    ledger.seen("a", True, 12.0)   # still looks up: a stopped runtime does until found hung
    ledger.seen("a", False, 20.0)
    ledger.seen("a", True, 40.0)
    ledger.requests += [
        ("a", 9.0, 11.0, 502),    # overlaps the fault: expected
        ("a", 30.0, 31.0, 504),   # inside it: expected
        ("a", 50.0, 51.0, 502),   # after the model served again: a defect
        ("b", 20.0, 21.0, 502),   # another model, never faulted: a defect
        ("a", 20.0, 21.0, 500),   # a 500 is never expected
        ("a", 20.0, 21.0, 599),   # a reset (the client's code) neither
        ("b", 1.0, 2.0, None),    # no answer in time: hung
        ("b", 1.0, 2.0, 200), ("b", 1.0, 2.0, 429),
    ]
    result = ledger.classify()
    assert result["requests"] == 9
    assert result["unexpected_5xx"] == 4, result["unexpected"]
    assert result["hung_requests"] == 1


def test_a_fault_window_stays_open_until_the_model_was_down_and_serves_again() -> None:
    # Seed 1's first run counted a SIGSTOPped runtime's 504 as unexpected: the window had
    # closed when /health still said serving, before the hang was found.
    ledger = Ledger()
    ledger.fault("a", "stop_scheduler", 94.0)
    ledger.seen("a", True, 95.0)
    ledger.requests.append(("a", 109.0, 120.0, 504))
    assert ledger.classify()["unexpected_5xx"] == 0


def test_a_fault_never_followed_by_serving_covers_everything_after_it() -> None:
    ledger = Ledger()
    ledger.fault("a", "stop_scheduler", 5.0)
    ledger.requests.append(("a", 500.0, 501.0, 503))
    assert ledger.classify()["unexpected_5xx"] == 0


def test_the_documented_duration_parses() -> None:
    args = build_parser().parse_args(["--json", "--duration", "120"])
    assert args.duration == 120 and args.json


def test_the_hog_and_the_new_faults_are_part_of_the_run() -> None:
    from fineslab.bench.chaos import FAULTS

    args = build_parser().parse_args(["--json", "--duration", "120", "--hog", "2"])
    assert args.hog == 2
    assert {"abandon", "budget"} <= set(FAULTS)


def test_every_fault_kind_happens_once_the_faults_cover_them() -> None:
    import random

    from fineslab.bench.chaos import FAULTS, _schedule

    kinds = _schedule(random.Random(3), len(FAULTS) + 2)
    assert set(kinds) == set(FAULTS) and len(kinds) == len(FAULTS) + 2
