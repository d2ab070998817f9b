"""torch's ``test/distributed/elastic/rendezvous/utils_test.py``: reading an endpoint and
the ``--rdzv-conf`` string.

Ported (12 tests, as 10 test functions): the 6 of ``parse_rendezvous_endpoint`` (aelastic's
of the same name, same messages), the 4 of ``_parse_rendezvous_config`` through aelastic's
public path for that string, ``aelastic.run``'s ``--rdzv-conf`` (torch's function is
private), and the 2 of ``_try_parse_port``, which ``parse_rendezvous_endpoint`` applies.
``_matches_machine_hostname`` decides which node hosts ``c10d``: it is ported as that
behaviour in ``test_c10d_rendezvous_backend.py``. Not ported: ``PeriodicTimerTest`` (torch's
keep-alive thread; aelastic's heartbeats are a task of the handler's event loop, tested by
``tests/rendezvous/test_heartbeat.py``).
"""

from __future__ import annotations

import pytest

from aelastic.core.params import parse_rendezvous_endpoint
from aelastic.run import config_from_args, parse_args

ENDPOINTS = [
    f"{host}:{port}"
    for host in ("dummy.com", "dummy-1.com", "123.123.123.123", "[2001:db8::1]")
    for port in (0, 123, 65535)
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_parse_rendezvous_endpoint_returns_tuple(endpoint: str) -> None:
    host, port = parse_rendezvous_endpoint(endpoint, default_port=123)
    expected_host, expected_port = endpoint.rsplit(":", 1)
    assert (host, port) == (expected_host.strip("[]"), int(expected_port))


@pytest.mark.parametrize(
    "endpoint", ["dummy.com", "dummy-1.com", "123.123.123.123", "[2001:db8::1]"]
)
def test_parse_rendezvous_endpoint_returns_tuple_if_endpoint_has_no_port(endpoint: str) -> None:
    assert parse_rendezvous_endpoint(endpoint, default_port=123) == (endpoint.strip("[]"), 123)


@pytest.mark.parametrize("endpoint", ["", "  "])
def test_parse_rendezvous_endpoint_returns_tuple_if_endpoint_is_empty(endpoint: str) -> None:
    assert parse_rendezvous_endpoint(endpoint, default_port=123) == ("localhost", 123)


@pytest.mark.parametrize("endpoint", ["~", "dummy.com :123", "~:123", ":123"])
def test_parse_rendezvous_endpoint_raises_error_if_hostname_is_invalid(endpoint: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^The hostname of the rendezvous endpoint '{endpoint}' must be a dot-separated "
        r"list of labels, an IPv4 address, or an IPv6 address.$",
    ):
        parse_rendezvous_endpoint(endpoint, default_port=123)


@pytest.mark.parametrize(
    "endpoint", ["dummy.com:", "dummy.com:abc", "dummy.com:-123", "dummy.com:-", "dummy.com: 1"]
)
def test_parse_rendezvous_endpoint_raises_error_if_port_is_invalid(endpoint: str) -> None:
    """Also ``test_try_parse_port_returns_none_if_str_is_invalid`` (``" 1"``, ``"abc"``)."""
    with pytest.raises(
        ValueError,
        match=rf"^The port number of the rendezvous endpoint '{endpoint}' must be an integer "
        r"between 0 and 65536.$",
    ):
        parse_rendezvous_endpoint(endpoint, default_port=123)


@pytest.mark.parametrize("endpoint", ["dummy.com:65536", "dummy.com:70000"])
def test_parse_rendezvous_endpoint_raises_error_if_port_is_too_big(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"must be an integer between 0 and 65536.$"):
        parse_rendezvous_endpoint(endpoint, default_port=123)


def _rdzv_conf(text: str) -> dict[str, object]:
    args = parse_args(["--rdzv-conf", text, "train.py"])
    config, _, _ = config_from_args(args)
    return config.rdzv_configs


def test_parse_rendezvous_config_returns_dict() -> None:
    config = _rdzv_conf(" b= dummy2  ,c=dummy3=dummy4,  a =dummy1,d=dummy5/dummy6")
    expected = {"a": "dummy1", "b": "dummy2", "c": "dummy3=dummy4", "d": "dummy5/dummy6"}
    assert {key: config[key] for key in expected} == expected


@pytest.mark.parametrize("text", ["", "   "])
def test_parse_rendezvous_returns_empty_dict_if_str_is_empty(text: str) -> None:
    assert set(_rdzv_conf(text)) <= {"timeout"}  # the launch's legacy timeout only


@pytest.mark.parametrize(
    "text",
    [
        "a=dummy1,",
        "a=dummy1,,c=dummy2",
        "a=dummy1,   ,c=dummy2",
        "a=dummy1,=  ,c=dummy2",
        "a=dummy1, = ,c=dummy2",
        "a=dummy1,  =,c=dummy2",
        " ,  ",
    ],
)
def test_parse_rendezvous_raises_error_if_str_is_invalid(text: str) -> None:
    with pytest.raises(ValueError, match="rdzv-conf"):
        _rdzv_conf(text)


@pytest.mark.parametrize(
    "text", ["b=dummy1,a,c=dummy2", "b=dummy1,c=dummy2,a", "b=dummy1,a=,c=dummy2", "  a "]
)
def test_parse_rendezvous_raises_error_if_value_is_empty(text: str) -> None:
    with pytest.raises(ValueError, match=r"option 'a' must have a value"):
        _rdzv_conf(text)
