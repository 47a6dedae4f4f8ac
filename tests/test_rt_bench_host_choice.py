"""`python -m strata_runtime.bench.host_choice`: the host's token choice timed with top-p by whole-row sorts
and by candidates, in one run."""

from __future__ import annotations

import json

import pytest

from strata_runtime.bench import host_choice


def test_it_times_every_case_and_finds_the_same_distribution(capsys) -> None:
    assert host_choice.main(["--vocab", "3000", "--rows", "2", "--repeats", "2", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["case"] for r in results] == list(host_choice.CASES)
    assert all(r["same"] and r["sorted_ms"] > 0 and r["candidates_ms"] > 0 for r in results)


def test_the_table_names_the_rows_and_the_vocabulary(capsys) -> None:
    assert host_choice.main(["--vocab", "2000", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "choosing on the host, 1 row(s) of 2,000 logits, ms per call (medians)"
    assert len(out) == 2 + len(host_choice.CASES)
    assert all(line.rstrip().endswith("True") for line in out[2:])


def test_logprobs_are_timed_against_the_hosts_choice(capsys) -> None:
    assert host_choice.main(["--logprobs", "--vocab", "3000", "--rows", "2", "--repeats", "2", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["case"] for r in results] == ["top 0", f"top {host_choice.MAX_TOP_LOGPROBS}"]
    assert all(r["logprobs_ms"] > 0 and r["choice_ms"] > 0 for r in results)
    assert host_choice.main(["--logprobs", "--vocab", "2000", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "log-probabilities on the host, 1 row(s) of 2,000 logits, ms per call (medians)"
    assert len(out) == 4 and all(line.endswith("x") for line in out[2:])


@pytest.mark.parametrize("flag", ["--vocab", "--rows", "--repeats"])
def test_a_count_below_one_is_refused_naming_the_option(flag, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        host_choice.main([flag, "0"])
    assert exc.value.code == 2
    assert f"{flag} must be at least 1, not 0" in capsys.readouterr().err
