"""Hypothesis strategies for arbitrary protobuf messages, driven by the message descriptor.

Every field may be left unset or filled with something hostile for its type: wrong-range and
negative integers, NaN/inf floats, empty/long/odd strings, unknown enum values, huge repeated
fields (100k-1M elements), nested messages (depth-limited), map entries. ``KNOWN`` strings (ids
that exist on the server under test) are mixed in so requests get past "not found" into deeper
validation.

    st_message(trajectory_pb2.OpenStepRequest.DESCRIPTOR, known=("job-1", "ex-1"))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 3


def _scalar(field: FieldDescriptor, known: Sequence[str]) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        edges = [v for v in (0, 1, -1, 2, 7, 64, 4096, 10**6, lo, hi) if lo <= v <= hi]
        return st.one_of(st.sampled_from(edges), st.integers(max(lo, -100), min(hi, 1000)), st.integers(lo, hi))
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        width = 32 if t == F.TYPE_FLOAT else 64
        return st.one_of(st.sampled_from([0.0, -1.0, 0.5, 1.0, 1e9, float("nan"), float("inf"), float("-inf")]),
                         st.floats(width=width, allow_nan=True, allow_infinity=True))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(st.sampled_from(["", *known]), st.text(max_size=24),
                         st.sampled_from(["x" * 5000, "../../etc/passwd", "a/b", "\x00", "é" * 40, " "]))
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=48), st.sampled_from([b"", b"\x00" * 70_000]))
    if t == F.TYPE_ENUM:
        top = max(v.number for v in field.enum_type.values)
        return st.integers(-1, top + 2)
    raise TypeError(f"unsupported field type {t} of {field.full_name}")


def _repeated_scalar(field: FieldDescriptor, known: Sequence[str]) -> st.SearchStrategy[list[Any]]:
    small = st.lists(_scalar(field, known), max_size=6)
    if field.type in _INT_RANGES:  # token-id style arrays: also huge ones
        return st.one_of(small, st.sampled_from([100_000, 1_000_000]).map(lambda n: [3] * n))
    return small


def _map(field: FieldDescriptor, known: Sequence[str], depth: int) -> st.SearchStrategy[dict[Any, Any]]:
    entry = field.message_type
    key_f, value_f = entry.fields_by_name["key"], entry.fields_by_name["value"]
    values = (st_message(value_f.message_type, known, depth + 1) if value_f.type == F.TYPE_MESSAGE
              else _scalar(value_f, known))
    return st.dictionaries(_scalar(key_f, known), values, max_size=4)


def st_message(desc: Descriptor, known: Sequence[str] = (), depth: int = 0) -> st.SearchStrategy[Message]:
    """Arbitrary (mostly invalid) instances of the message ``desc``."""
    cls = message_factory.GetMessageClass(desc)
    if depth > MAX_DEPTH:
        return st.just(cls())
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            s = _map(field, known, depth)
        elif field.type == F.TYPE_MESSAGE:
            one = st.deferred(lambda f=field: st_message(f.message_type, known, depth + 1))
            s = st.lists(one, max_size=3) if field.is_repeated else one
        elif field.is_repeated:
            s = _repeated_scalar(field, known)
        else:
            s = _scalar(field, known)
        parts[field.name] = st.one_of(st.none(), s)
    return st.fixed_dictionaries(parts).map(lambda values: _build(cls, desc, values))


def _build(cls: type[Message], desc: Descriptor, values: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in values.items():
        if value is None:
            continue
        field = desc.fields_by_name[name]
        target = getattr(msg, name)
        if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            for k, v in value.items():
                if isinstance(v, Message):
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            if field.type == F.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.extend(value)
        elif field.type == F.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(msg, name, value)  # a later member of a oneof replaces an earlier one
    return msg
