"""How the serve benchmark picks its comparison rate and reads its keys."""

from __future__ import annotations

import pytest

from bench.http_load import poisson_arrivals
from bench.serve import comparison_point, read_keys


def _sweep(attainments: list[float]) -> list[dict]:
    return [
        {"rate_rps": rate, "systems": {"peer": {"slo_attainment": a}}}
        for rate, a in zip([0.5, 1.0, 2.0], attainments, strict=False)
    ]


def test_comparison_rate_is_where_the_reference_starts_missing():
    point, note = comparison_point(_sweep([1.0, 0.95, 0.4]), "peer", 0.9)
    assert point["rate_rps"] == 2.0 and "starts missing" in note
    point, note = comparison_point(_sweep([1.0, 1.0, 1.0]), "peer", 0.9)
    assert point["rate_rps"] == 2.0 and "higher rates" in note
    point, note = comparison_point(_sweep([0.2, 0.1, 0.0]), "peer", 0.9)
    assert point["rate_rps"] == 0.5 and "lower rates" in note


def test_keys_file_gives_one_key_per_tenant(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# demo keys\nwk-a\n\nwk-b\nwk-c\n")
    assert read_keys(str(path), 2) == ["wk-a", "wk-b"]
    assert read_keys(str(path), None) == ["wk-a", "wk-b", "wk-c"]
    assert read_keys(None, 1) == [None]
    with pytest.raises(SystemExit, match="holds 3 key"):
        read_keys(str(path), 4)
    with pytest.raises(SystemExit, match="needs --keys"):
        read_keys(None, 2)
    (tmp_path / "empty.txt").write_text("# none yet\n")
    with pytest.raises(SystemExit, match="holds no key"):
        read_keys(str(tmp_path / "empty.txt"), None)
    with pytest.raises(SystemExit, match="cannot read"):
        read_keys(str(tmp_path / "missing.txt"), 1)


def test_poisson_arrivals_are_seeded_and_match_the_rate():
    arrivals = poisson_arrivals(2000, rate=4.0, seed=3)
    assert arrivals == poisson_arrivals(2000, rate=4.0, seed=3)
    assert arrivals == sorted(arrivals)
    assert 2000 / arrivals[-1] == pytest.approx(4.0, rel=0.1)
