"""`--tp` starting its own ranks: the ports it hands them."""

from __future__ import annotations

import socket

import pytest

from server import ranks
from server.settings import read_environment


def effective_link_port(env: dict[str, str]) -> int:
    """The control link port a rank with this environment listens on or connects to."""
    return ranks.control_link_port(ranks.rank_env(None, env), read_environment(env).link_port)


def test_the_link_port_is_free_even_when_the_port_after_the_masters_is_taken(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([[taken - 1, ranks.free_port()]])
        monkeypatch.setattr(ranks, "free_ports", lambda count: next(picks)[:count])
        envs = ranks.rank_environments(2, {})
        links = {effective_link_port(env) for env in envs}
        assert len(links) == 1 and taken not in links
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", links.pop()))  # free: rank 0 can listen on it
    assert [(env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) for env in envs] == [("0", "0", "2"), ("1", "1", "2")]
    assert {env["MASTER_PORT"] for env in envs} == {str(taken - 1)}


def test_a_link_port_the_user_set_is_kept():
    envs = ranks.rank_environments(2, {"FLASHNEXT_LINK_PORT": "40123"})
    assert [effective_link_port(env) for env in envs] == [40123, 40123]


@pytest.mark.parametrize("count", [1, 2, 5])
def test_free_ports_are_distinct_and_bindable(count):
    ports = ranks.free_ports(count)
    assert len(set(ports)) == count
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
