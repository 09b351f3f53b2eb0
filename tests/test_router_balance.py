"""Session placement in ``InferenceRouter``: consistent hashing with bounded loads, and exact per-server
counts. ``pick`` is routing logic only, so these drive a router that is never started (no server is
contacted); the placement over real servers is covered in tests/test_router.py."""

from __future__ import annotations

import bisect
import math
from collections import Counter

import pytest

from rollflow.cli import main
from rollflow.inference.router import VIRTUAL_NODES, InferenceRouter, _hash

URLS = [f"http://127.0.0.1:{port}" for port in (41017, 41018, 52311)]


def assert_counts_exact(router: InferenceRouter) -> None:
    """Each server's count is the number of sessions the table pins to it."""
    pinned = Counter(router._sessions.values())
    assert {url: worker.sessions for url, worker in router.workers.items()} == {
        url: pinned.get(url, 0) for url in router.workers
    }
    assert set(pinned) <= {url for url, worker in router.workers.items() if worker.healthy}


def plain_ring_owner(urls: list[str], session_id: str) -> str:
    """Where plain consistent hashing (no load bound) puts ``session_id``: an oracle built apart from the
    router's code."""
    ring = sorted((_hash(f"{url}#{index}"), url) for url in urls for index in range(VIRTUAL_NODES))
    keys = [key for key, _ in ring]
    return ring[bisect.bisect(keys, _hash(session_id)) % len(ring)][1]


def spread(router: InferenceRouter) -> int:
    counts = [worker.sessions for worker in router.workers.values() if worker.healthy]
    return max(counts) - min(counts)


@pytest.mark.parametrize("servers", [2, 3])
def test_default_bound_keeps_servers_within_one_session(servers):
    urls = URLS[:servers]
    router = InferenceRouter(urls)
    plain = Counter(plain_ring_owner(urls, f"bench-{index}") for index in range(256))
    for index in range(256):
        router.pick(f"bench-{index}")
        assert spread(router) <= 1, index
    assert_counts_exact(router)
    # The ring alone would not have balanced these sessions: the bound is what does it.
    assert max(plain.values()) - min(plain.values()) > 1, plain


@pytest.mark.parametrize("factor", [1.25, 2.0])
def test_a_looser_bound_caps_each_server(factor):
    router = InferenceRouter(URLS, balance_factor=factor)
    for index in range(300):
        bound = math.ceil(factor * (index + 1) / len(URLS))
        worker = router.pick(f"s-{index}")
        assert worker is not None and worker.sessions <= bound
    assert_counts_exact(router)


def test_a_huge_factor_is_plain_consistent_hashing():
    router = InferenceRouter(URLS, balance_factor=1e9)
    for index in range(200):
        session_id = f"s-{index}"
        assert router.pick(session_id).url == plain_ring_owner(URLS, session_id)


def test_pinned_sessions_never_move_when_the_balance_changes():
    router = InferenceRouter(URLS[:2])
    owners = {f"s-{index}": router.pick(f"s-{index}").url for index in range(40)}
    first, second = URLS[:2]
    # Finish every session of the first server: the second now holds all that are left.
    for session_id in [sid for sid, url in owners.items() if url == first]:
        assert router.finish_session(session_id)
        del owners[session_id]
    assert_counts_exact(router)
    assert router.workers[first].sessions == 0 and router.workers[second].sessions == 20
    for _ in range(2):
        for session_id, url in owners.items():
            assert router.pick(session_id).url == url
    # New sessions fill the emptied server; the pinned ones stay where they are.
    new = [router.pick(f"new-{index}").url for index in range(19)]
    assert new == [first] * 19
    assert all(router.pick(session_id).url == url for session_id, url in owners.items())
    assert_counts_exact(router)


def test_counts_stay_exact_through_every_change():
    router = InferenceRouter(URLS, max_sessions=50)
    for index in range(80):  # past max_sessions: the least recently used are forgotten
        router.pick(f"s-{index}")
    assert len(router._sessions) == 50 and "s-0" not in router._sessions
    assert_counts_exact(router)
    assert sum(worker.sessions for worker in router.workers.values()) == 50
    assert not router.finish_session("s-0") and router.finish_session("s-79")
    assert_counts_exact(router)
    # A retry excludes the session's server: it is re-placed, off the old count and onto the new one.
    owner = router._sessions["s-78"]
    moved = router.pick("s-78", exclude={owner})
    assert moved.url != owner and router._sessions["s-78"] == moved.url
    assert_counts_exact(router)
    # A dead server's sessions are forgotten, and placement carries on over the others.
    dead = router.workers[URLS[0]]
    router._mark_dead(dead, "test")
    assert dead.sessions == 0
    assert_counts_exact(router)
    for index in range(100, 130):
        assert router.pick(f"s-{index}").url != dead.url
    assert_counts_exact(router)
    assert spread(router) <= 1
    router._mark_alive(dead)
    for index in range(200, 230):  # new sessions go to the server back in until it has caught up
        router.pick(f"s-{index}")
    assert_counts_exact(router)
    assert dead.sessions > 0
    assert router.remove_worker(URLS[1])
    assert_counts_exact(router)
    assert router.add_worker(URLS[1])
    assert router.workers[URLS[1]].sessions == 0
    assert_counts_exact(router)
    rows = {row["url"]: row["sessions"] for row in router.worker_table()}
    assert rows == {url: worker.sessions for url, worker in router.workers.items()}


def test_every_server_at_the_bound_but_excluded_still_gets_the_retry():
    first, second = URLS[:2]
    router = InferenceRouter([first, second])
    for index in range(10):
        router.pick(f"s-{index}")
    assert router.workers[first].sessions == router.workers[second].sessions == 5
    # A new session whose only candidate is at the bound is still placed (not refused).
    assert router.pick("new", exclude={first}).url == second
    assert router.pick("other", exclude={first, second}) is None
    assert_counts_exact(router)


@pytest.mark.parametrize("factor", [0.5, 0.999, math.nan, math.inf, -1, "2", True, None])
def test_bad_balance_factor_is_refused_by_name(factor):
    with pytest.raises(ValueError, match=r"balance_factor must be a finite number >= 1\.0"):
        InferenceRouter(URLS, balance_factor=factor)


@pytest.mark.parametrize("text", ["0.5", "nan", "abc", "inf"])
def test_cli_bad_balance_factor_is_a_usage_error(text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--server", URLS[0], "--balance-factor", text])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--balance-factor" in error and repr(text) in error and ">= 1.0" in error
