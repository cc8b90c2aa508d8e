"""mesh.metrics: an app-owned registry, pre-bound children, live collectors."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from mesh.metrics import Metrics


def test_two_apps_do_not_share_a_registry() -> None:
    a, b = Metrics(), Metrics()  # the global registry would refuse the second set of names
    a.request_done("chat", 200)
    a.request_done("chat", 200)
    b.request_done("chat", 500)
    assert 'mesh_requests_total{route="chat",status="200"} 2.0' in a.render().decode()
    assert 'status="200"' not in b.render().decode()


def test_live_collectors_are_read_at_scrape_time() -> None:
    m = Metrics()
    state = {"in_flight": 1}

    def families() -> list[GaugeMetricFamily]:
        g = GaugeMetricFamily("mesh_test_in_flight", "test", labels=["target"])
        g.add_metric(["w"], state["in_flight"])
        return [g]

    m.add_collector(families)
    assert 'mesh_test_in_flight{target="w"} 1.0' in m.render().decode()
    state["in_flight"] = 7
    assert 'mesh_test_in_flight{target="w"} 7.0' in m.render().decode()


def test_other_modules_can_add_metrics() -> None:
    m = Metrics()
    c = m.counter("mesh_kv_events_total", "events", ["worker"])
    c.labels("w").inc(3)
    assert 'mesh_kv_events_total{worker="w"} 3.0' in m.render().decode()
