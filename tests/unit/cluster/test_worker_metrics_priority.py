"""SGLang with priority scheduling: its running / waiting gauges carry the total under
``priority=""`` beside one line per priority; the total is read once, not added to its parts."""

from __future__ import annotations

from mesh.cluster.worker_metrics import parse

BREAKDOWN_AND_TOTAL = b"""\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",priority="",tp_rank="0"} 5.0
sglang:num_running_reqs{model_name="m",priority="0",tp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",priority="1",tp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="m",priority="",tp_rank="0"} 4.0
sglang:num_queue_reqs{model_name="m",priority="0",tp_rank="0"} 4.0
"""

BREAKDOWN_ONLY = b"""\
sglang:num_running_reqs{model_name="m",priority="0"} 3.0
sglang:num_running_reqs{model_name="m",priority="1"} 2.0
"""


def test_the_total_line_is_read_alone_when_the_body_has_it() -> None:
    load = parse(BREAKDOWN_AND_TOTAL)[None]
    assert (load.num_running, load.num_waiting) == (5, 4)


def test_without_a_total_the_priorities_are_added_up() -> None:
    assert parse(BREAKDOWN_ONLY)[None].num_running == 5
