"""``mesh replay``: agent traces played live against any OpenAI-compatible endpoint.

One module per job:

- ``prompts``: deterministic prompts from a trace's chained block keys (equal prefixes give
  byte-identical prompts), and the trace's ideal hit rate at the replay's token scale;
- ``schedule``: which requests are sent, in which session group, released by what (closed-loop
  turns after their predecessor finished plus a scaled, capped think time; open-loop arrivals);
- ``client``: the async HTTP client (httpx, streaming ``/v1/completions``) that plays the schedule
  with at most N session groups in flight and measures every request;
- ``report``: the metrics (the same JSON shape as ``mesh simulate``'s, via
  ``simulator.report.summarize``), the table, the side-by-side comparison, JSON and HTML;
- ``progress``: a progress line that also works when stderr is not a terminal.

No torch anywhere: it runs wherever the gateway runs.
"""

from __future__ import annotations
