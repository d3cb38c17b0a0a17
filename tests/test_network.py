import socket

import pytest

from gyre.network import node_address


def test_one_machine_stays_on_loopback(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert node_address() == "127.0.0.1"
    assert node_address("localhost") == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert node_address() == "127.0.0.1"


def test_a_remote_master_gives_a_local_non_loopback_address():
    try:
        addr = node_address("192.0.2.123")  # a documentation address: only the route is looked up
    except OSError:
        pytest.skip("this machine has no route off loopback")
    assert not addr.startswith("127.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))  # binds only to an address of this machine: servers can listen there


def test_an_unresolvable_master_is_an_error():
    with pytest.raises(OSError):
        node_address("no-such-host.invalid")


def test_gyre_node_addr_names_the_address(monkeypatch):
    monkeypatch.setenv("GYRE_NODE_ADDR", "127.0.0.2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert node_address() == "127.0.0.2"
    monkeypatch.setenv("GYRE_NODE_ADDR", "")  # empty: the route, as unset
    assert node_address() == "127.0.0.1"
