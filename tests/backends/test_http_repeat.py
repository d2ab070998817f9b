"""A channel message repeating the last keep-alive but for its id is known without parsing,
and only when JSON would read it the same (``server/_repeat.py``)."""

from __future__ import annotations

from aelastic.backends.http.server._repeat import repeat_id, tail

FIRST = '{"id":7,"run":"r","request":{"op":"keep_alive"},"hold":1.0,"beat":"k"}'


def test_a_repeat_is_known_by_the_text_after_its_id() -> None:
    known = tail(FIRST, 7)
    assert known == ',"run":"r","request":{"op":"keep_alive"},"hold":1.0,"beat":"k"}'
    assert repeat_id('{"id":8' + known, known) == 8
    assert repeat_id('{"id":0' + known, known) == 0
    assert repeat_id('{"id":8,"run":"other"}', known) is None  # another request


def test_only_a_plain_json_id_in_range_is_read() -> None:
    known = tail(FIRST, 7)
    assert known is not None
    for bad in ("08", "-1", "1.0", "1e3", " 8", "8 ", "\uff19", str(2**53), "1" * 17):
        assert repeat_id('{"id":' + bad + known, known) is None, bad  # parsed as usual


def test_a_message_whose_id_is_not_alone_first_is_never_a_model() -> None:
    assert tail('{"id":7,"run":"r","id":9}', 7) is None  # JSON's id would be the last: 9
    assert tail('{"id":7,"run":"r","\\u0069d":9}', 7) is None  # the same, escaped
    assert tail('{"run":"r","id":7}', 7) is None
    assert tail('{"id": 7,"run":"r"}', 7) is None
    assert tail('{"id":7}', 7) is None
    assert tail(FIRST, 8) is None  # not the id JSON read
