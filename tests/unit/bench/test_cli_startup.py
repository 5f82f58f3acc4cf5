"""lmdq_bench.cli_startup: reading ``python -X importtime``'s report (issue 49's measure)."""

from __future__ import annotations

from lmdq_bench.cli_startup import import_ms, parse_importtime, split_startup

REPORT = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 |   encodings.utf_8
import time:       200 |        300 | encodings
import time:       900 |       5000 | site
import time:        50 |         50 | runpy
import time:      1000 |       1000 |     b.c
import time:      2000 |       3000 |   b
import time:      4000 |      40000 | a
some other line the program wrote
import time:       500 |        500 | late
"""


def test_parse_keeps_order_depth_and_times() -> None:
    rows = parse_importtime(REPORT)
    assert [(r.name, r.depth) for r in rows] == [("encodings.utf_8", 1), ("encodings", 0), ("site", 0), ("runpy", 0),
                                                 ("b.c", 2), ("b", 1), ("a", 0), ("late", 0)]
    assert rows[-2].self_us == 4000 and rows[-2].cumulative_us == 40000


def test_the_program_starts_after_site_and_only_top_level_imports_are_summed() -> None:
    interpreter, program = split_startup(parse_importtime(REPORT))
    assert [r.name for r in interpreter][-1] == "site" and [r.name for r in program][0] == "runpy"
    assert import_ms(program) == (50 + 40000 + 500) / 1000  # b and b.c are inside a's cumulative
    assert import_ms(interpreter) == (300 + 5000) / 1000
