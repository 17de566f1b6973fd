"""`raylift report` (tools/report/) as a new user meets it: the goodput split of a run
with a journal (lines and the PNG's stacked bar), a folder with no run (exit 2, no plot),
and a bucket it cannot reach (one line, exit 2, no traceback)."""

from __future__ import annotations

import json
import socket

from tests.unit.observability.test_goodput import _run
from tools import report


def _write(run_dir, records, journal) -> None:
    (run_dir / "journal").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "journal" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in journal))


def test_report_prints_the_goodput_split_and_draws_it(tmp_path, capsys):
    records, journal = _run()
    for r in records:
        r.setdefault("loss", 2.0)
        r.setdefault("tokens_per_s", 100.0)
    run_dir = tmp_path / "runs" / "r1"
    _write(run_dir, records, journal)
    out = tmp_path / "r1.png"
    assert report.main([str(run_dir), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "goodput: runtime 22.9% of 0.039 paid accelerator-hours" in text
    assert "retrained: worker kill" in text and "no node prices" in text
    run = report.load_run(str(run_dir))
    assert run["goodput"].parts["kept"] > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_with_no_run_says_so_and_exits_2_without_a_plot(tmp_path, capsys):
    out = tmp_path / "none.png"
    assert report.main([str(tmp_path / "nothing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no run here" in err and "\n" not in err.strip()
    assert not out.exists()


def test_an_unreachable_bucket_is_one_line(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = report.main(
        [
            "s3://nobucket/run",
            "--endpoint-override",
            f"http://127.0.0.1:{port}",
            "--out",
            str(tmp_path / "x.png"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: s3://nobucket/run: storage not readable")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
