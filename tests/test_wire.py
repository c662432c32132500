"""Property tests of the wire layer: framing, schemas, handshake proofs."""

from __future__ import annotations

import types
import typing
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire import handshake
from wire import messages  # noqa: F401  (registers every kind)
from wire.errors import COMMAND_INVALID, FrameError, ProtocolError
from wire.frames import HEADER, FrameDecoder, encode_frame
from wire.schema import REGISTRY, decode, to_wire

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


def _splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points + [len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


@FAST
@given(st.lists(values, min_size=1, max_size=6), st.lists(st.integers(min_value=0), max_size=12))
def test_frame_round_trip_in_arbitrary_chunks(vals, cuts):
    data = b"".join(encode_frame(v) for v in vals)
    dec = FrameDecoder()
    got = []
    for chunk in _splits(data, cuts):
        got.extend(dec.feed(chunk))
    assert got == vals
    assert dec.pending == 0
    dec.check_eof()


@FAST
@given(st.binary(max_size=200), st.lists(st.integers(min_value=0), max_size=6))
def test_garbage_yields_values_or_frame_error(data, cuts):
    dec = FrameDecoder(max_frame=4096)
    try:
        for chunk in _splits(data, cuts):
            dec.feed(chunk)
        dec.check_eof()
    except FrameError:
        pass


def test_an_unfinished_frame_from_a_reused_buffer_is_kept_as_it_was():
    # the decoder keeps the start of an unfinished frame without copying bytes objects; a
    # mutable buffer (its owner may refill it) must be copied, or the frame is corrupted
    data = encode_frame(["a", 1]) + encode_frame(["b" * 50, 2])
    buf = bytearray(data[:20])
    dec = FrameDecoder()
    assert dec.feed(buf) == [["a", 1]]
    assert dec.pending == 20 - len(encode_frame(["a", 1]))
    buf[:] = b"\xff" * len(buf)
    assert dec.feed(data[20:]) == [["b" * 50, 2]]
    assert dec.pending == 0


@pytest.mark.parametrize("keep", [FrameDecoder.ASSEMBLY_KEEP, 10])
def test_frames_assembled_across_reads_share_no_memory_with_what_was_decoded(keep):
    # frames longer than a read are assembled in one buffer every decoder of the thread reuses
    # (or, past ASSEMBLY_KEEP, joined afresh); what a frame decoded to must not change when the
    # next frame is assembled in the same place, nor may a tail left over from the buffer
    from wire.frames import _assembly
    _assembly.__dict__.pop("buf", None)  # start with no kept buffer (other tests made one)
    bodies = [bytes([i]) * 3000 for i in range(1, 5)]
    stream = b"".join(encode_frame(["m", b]) for b in bodies)
    dec = FrameDecoder()
    dec.ASSEMBLY_KEEP = keep
    got = []
    for start in range(0, len(stream), 1000):  # reads of 1,000 bytes: every frame spans reads
        got.extend(dec.feed(stream[start:start + 1000]))
    assert got == [["m", b] for b in bodies]
    assert dec.pending == 0
    if keep > 10:
        assert len(_assembly.buf) >= 3000  # one kept buffer served every frame
    else:
        assert not hasattr(_assembly, "buf")  # past ASSEMBLY_KEEP nothing is kept


def test_oversized_frame_refused_on_encode_and_decode():
    with pytest.raises(FrameError, match="5000"):
        encode_frame(b"x" * 4997, max_frame=4096)  # bin32 header: 3 bytes
    dec = FrameDecoder(max_frame=4096)
    with pytest.raises(FrameError, match="4097"):
        dec.feed(HEADER.pack(4097))
    # nothing is buffered waiting for the body
    assert FrameDecoder(max_frame=4096).feed(HEADER.pack(4096)) == []


def test_empty_frame_and_truncation_refused():
    with pytest.raises(FrameError):
        FrameDecoder().feed(HEADER.pack(0))
    dec = FrameDecoder()
    dec.feed(encode_frame([1, 2, 3])[:-1])
    with pytest.raises(FrameError, match="middle of a frame"):
        dec.check_eof()


# --- schemas ------------------------------------------------------------------------------

def strategy_for(tp):
    if tp is Any:
        return values
    if tp is int:
        return st.integers(min_value=-(2**63), max_value=2**63 - 1)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is bool:
        return st.booleans()
    if tp is str:
        return st.text(max_size=20)
    if tp is bytes:
        return st.binary(max_size=20)
    if tp is dict:
        return st.dictionaries(st.text(max_size=8), values, max_size=3)
    if tp is list:
        return st.lists(values, max_size=3)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return instances(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return st.one_of([st.none() if a is type(None) else strategy_for(a) for a in args])
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=4)
    if origin is tuple:
        return st.tuples(*[strategy_for(a) for a in args])
    raise AssertionError(f"no strategy for {tp!r}")


def instances(cls):
    hints = typing.get_type_hints(cls)
    fields = cls.__struct_fields__
    return st.builds(lambda *a: cls(*a), *[strategy_for(hints[f]) for f in fields])


ALL_KINDS = sorted(REGISTRY)


def test_registry_covers_messages_module():
    assert len(ALL_KINDS) >= 30
    for kind in ("hello", "publish", "deliver", "meta.propose", "ctl.reply", "tick", "raft.append",
                 "q.publish", "r.rep", "to.session"):
        assert kind in REGISTRY


@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schema_round_trip(kind, data):
    cls = REGISTRY[kind]
    msg = data.draw(instances(cls))
    wire_value = msgpack.unpackb(msgpack.packb(to_wire(msg), use_bin_type=True), raw=False,
                                 strict_map_key=False)
    back = decode(wire_value)
    assert type(back) is cls
    assert back == msg
    # and through the framing too
    (framed,) = FrameDecoder().feed(encode_frame(to_wire(msg)))
    assert decode(framed) == msg


def _bad_value_for(tp):
    """A value that does not type-check for tp (None for Any: everything passes)."""
    if tp is Any:
        return None
    if tp is str or tp is bytes or tp is dict:
        return 12345
    if tp in (int, float, bool, list):
        return "not-that"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "not-that"
    if origin in (types.UnionType, typing.Union):
        return object_that_fails(typing.get_args(tp))
    if origin is list:
        return {"a": 1}
    return None


def object_that_fails(args):
    for cand in ({"m": 1}, "s", 1.5, [object]):
        # pick a candidate not matched by any alternative
        ok = False
        for a in args:
            if a is type(None):
                continue
            if a is Any or (a is dict and isinstance(cand, dict)) or (a is str and isinstance(cand, str)) \
                    or (a is float and isinstance(cand, float)) or typing.get_origin(a) is list \
                    and isinstance(cand, list) or a is list and isinstance(cand, list):
                ok = True
        if not ok:
            return cand
    return None


@pytest.mark.parametrize("kind", [k for k in ALL_KINDS if REGISTRY[k]._fields])
def test_wrong_field_type_names_the_field(kind):
    cls = REGISTRY[kind]
    hints = typing.get_type_hints(cls)
    base = []
    for f in cls._fields:
        base.append(_minimal(hints[f]))
    assert decode([kind, *base]) is not None
    tested = 0
    for i, f in enumerate(cls._fields):
        bad = _bad_value_for(hints[f])
        if bad is None:
            continue
        value = [kind, *base]
        value[1 + i] = bad
        with pytest.raises(ProtocolError) as ei:
            decode(value)
        assert repr(f) in ei.value.text and kind in ei.value.text
        tested += 1


def _minimal(tp):
    if tp is Any:
        return None
    if tp is int:
        return 0
    if tp is float:
        return 0.0
    if tp is bool:
        return False
    if tp is str:
        return ""
    if tp is bytes:
        return b""
    if tp is dict:
        return {}
    if tp is list:
        return []
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return None if type(None) in args else _minimal(args[0])
    if origin is list:
        return []
    if origin is tuple:
        return [_minimal(a) for a in args]
    raise AssertionError(tp)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_wrong_field_count_names_the_kind(kind):
    cls = REGISTRY[kind]
    base = [_minimal(typing.get_type_hints(cls)[f]) for f in cls._fields]
    for value in ([kind, *base, 1], [kind, *base[:-1]] if base else None):
        if value is None:
            continue
        with pytest.raises(ProtocolError) as ei:
            decode(value)
        assert repr(kind) in ei.value.text
        assert "fields" in ei.value.text


@FAST
@given(st.text(max_size=30).filter(lambda k: k not in REGISTRY))
def test_unknown_kind_refused(kind):
    with pytest.raises(ProtocolError) as ei:
        decode([kind, 1, 2])
    assert repr(kind[:64]) in ei.value.text


@FAST
@given(values.filter(lambda v: not (isinstance(v, list) and v and isinstance(v[0], str))))
def test_non_message_values_refused(v):
    with pytest.raises(ProtocolError):
        decode(v)


def test_disallowed_kind_and_error_passthrough():
    with pytest.raises(ProtocolError, match="not allowed here"):
        decode(["tick"], allowed=frozenset({"hello"}))
    with pytest.raises(ProtocolError) as ei:
        decode(["error", 403, "nope"], allowed=frozenset({"welcome"}))
    assert ei.value.code == 403 and ei.value.text == "nope"


def test_a_disallowed_kind_with_bad_fields_is_refused_as_disallowed():
    """A client that sends a peer-only kind hears that the kind is not allowed, not what is
    wrong with the fields it gave it (found by tests/test_native_fuzz.py)."""
    from wire.schema import decode_bytes
    data = msgpack.packb(["q.publish", "q", [], 1, [], None, True, 1])
    with pytest.raises(ProtocolError) as ei:
        decode_bytes(data, allowed=frozenset({"publish", "ack"}))
    assert ei.value.code == COMMAND_INVALID and ei.value.text == "message 'q.publish' is not allowed here"
    with pytest.raises(ProtocolError, match="field 'ch'"):  # an allowed kind still hears which field
        decode_bytes(msgpack.packb(["ack", "one", [1], 0]), allowed=frozenset({"publish", "ack"}))


# --- handshake ----------------------------------------------------------------------------

def test_secrets_that_differ_by_trailing_nuls_do_not_prove_each_other():
    # HMAC pads short keys with zero bytes: keyed by the raw secret, b"abc" proved b"abc\0"
    # (found by hypothesis: b"\0" against b"\0\0")
    nonce = handshake.new_nonce()
    for a, b in ((b"\0", b"\0\0"), (b"abc", b"abc\0")):
        assert not handshake.check_proof(b, nonce, "ctx", handshake.proof(a, nonce, "ctx"))


@FAST
@given(st.binary(min_size=1, max_size=16), st.binary(min_size=1, max_size=16), st.text(max_size=10))
def test_handshake_proof(secret, other, context):
    nonce = handshake.new_nonce()
    assert len(nonce) == handshake.NONCE_BYTES
    p = handshake.proof(secret, nonce, context)
    assert handshake.check_proof(secret, nonce, context, p)
    if other != secret:
        assert not handshake.check_proof(other, nonce, context, p)
    assert not handshake.check_proof(secret, nonce, context + "x", p)
    assert not handshake.check_proof(secret, handshake.new_nonce(), context, p)
