"""The in-band wire format (``trainer.sync.wire``): byte-compatible with the safetensors library both ways,
zero-copy decode, one copy per tensor on encode, and clear errors for malformed payloads."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from trainer.sync.wire import WireFormatError, decode, encode


def _tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 3, generator=g)
    return {
        "odd.bf16": torch.randn(7, generator=g).to(torch.bfloat16),   # 14 bytes: the next tensor starts unaligned
        "f32": torch.randn(3, 4, generator=g),
        "i64": torch.arange(5),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "flag": torch.tensor([True, False, True]),
        "tied.a": base,
        "tied.b": base,                                                # shared storage: written twice
        "strided": torch.randn(4, 6, generator=g)[:, ::2],             # not contiguous
    }


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def test_encode_is_read_by_the_safetensors_library():
    want = _tensors()
    blob = encode(want, {"peft_config": '{"r": 8}'})
    got = load(bytes(blob))
    _assert_same({k: got[k] for k in want}, want)
    header_len = struct.unpack_from("<Q", blob)[0]
    assert json.loads(bytes(blob[8:8 + header_len]))["__metadata__"] == {"peft_config": '{"r": 8}'}
    assert (8 + header_len) % 8 == 0


def test_decode_reads_the_safetensors_library_and_returns_views_of_the_payload():
    want = {k: v.contiguous().clone() for k, v in _tensors().items()}
    blob = save(want, metadata={"k": "v"})
    got, meta = decode(blob)
    _assert_same(got, want)
    assert meta == {"k": "v"}
    buf = encode({"w": torch.arange(6, dtype=torch.float32)})
    views, _ = decode(buf)
    lo = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert lo <= views["w"].data_ptr() < lo + len(buf), "decode copied an aligned tensor"
    buf[-4:] = struct.pack("<f", 42.0)
    assert views["w"][-1].item() == 42.0


def test_round_trip_keeps_every_tensor_and_an_empty_update():
    want = _tensors()
    got, meta = decode(encode(want))
    _assert_same(got, {k: v.contiguous() for k, v in want.items()})
    assert meta == {}
    assert decode(encode({}))[0] == {}


def _payload(header: bytes, data_bytes: int) -> bytes:
    return struct.pack("<Q", len(header)) + header + b"\0" * data_bytes


@pytest.mark.parametrize("blob,match", [
    (b"\x01\x02", "shorter than the 8-byte"),
    (struct.pack("<Q", 1000) + b"{}", "does not fit"),
    (struct.pack("<Q", 4) + b"nope", "not JSON"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (struct.pack("<Q", 8) + b'{"x": 1}', "malformed header entry"),
    (_payload(b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 8), "data_offsets \\[0, 16\\] do not hold"),
    (_payload(b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}', 16), "data_offsets \\[0, 16\\] do not hold"),
    (_payload(b'{"w":{"dtype":"Q99","shape":[4],"data_offsets":[0,16]}}', 16), "malformed header entry"),
])
def test_malformed_payloads_are_refused_naming_what_is_wrong(blob, match):
    with pytest.raises(WireFormatError, match=match):
        decode(blob)


def test_inband_transport_streams_one_declared_length_body_in_bounded_views(monkeypatch):
    """httpcore re-slices a ``bytes`` body after every partial send (``buffer = buffer[n:]``), copying the rest each
    time: a 1.5 GB update took minutes. The in-band transport sends zero-copy slices of at most BODY_CHUNK_BYTES
    with the length declared (no chunked encoding), and the server decodes exactly what was encoded."""
    import httpx

    from trainer.rollout.server_client import ServerEndpoint
    from trainer.sync import transports

    monkeypatch.setattr(transports, "BODY_CHUNK_BYTES", 1000)
    seen = {}

    class Recording(httpx.BaseTransport):  # sees the body as the connection would send it
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            chunks = list(request.stream)
            seen["sizes"] = [len(c) for c in chunks]
            seen["headers"] = request.headers
            seen["tensors"] = decode(b"".join(bytes(c) for c in chunks))[0]
            return httpx.Response(200, json={"message": "full weights loaded"})

    tr = transports.InbandTransport()
    tr.client = httpx.Client(transport=Recording())
    want = {"w": torch.randn(3000), "b": torch.arange(10)}
    assert tr.push_full(want, [ServerEndpoint("http://server:1")]) == {}
    total = sum(seen["sizes"])
    assert seen["headers"]["content-length"] == str(total) and "transfer-encoding" not in seen["headers"]
    assert max(seen["sizes"]) <= 1000 and len(seen["sizes"]) == -(-total // 1000)
    _assert_same(seen["tensors"], want)


def _decode_onto(device: str):
    want = {k: v.contiguous().clone() for k, v in _tensors().items()}
    blob = encode(want)
    got, _ = decode(blob, device=device)
    assert sorted(got) == sorted(want)
    for k, v in got.items():
        assert v.device.type == device and v.dtype == want[k].dtype and v.shape == want[k].shape, k
    return got, want


def test_decode_onto_a_device_gives_tensors_there_and_checks_the_header_first():
    _decode_onto("meta")
    bad = bytearray(encode({"w": torch.zeros(4)}))
    struct.pack_into("<Q", bad, 0, 1 << 40)
    with pytest.raises(WireFormatError, match="header length"):
        decode(bad, device="meta")


@pytest.mark.gpu
def test_decode_onto_cuda_is_exact():
    got, want = _decode_onto("cuda")
    for k in want:
        assert torch.equal(got[k].cpu(), want[k]), k


def test_encode_into_a_given_staging_buffer_is_the_same_payload_and_reuses_it():
    want = _tensors()
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    asked = []

    def allocate(n):
        asked.append(n)
        return staging

    blob = encode(want, {"k": "v"}, allocate)
    assert isinstance(blob, memoryview) and bytes(blob) == bytes(encode(want, {"k": "v"}))
    assert asked == [len(blob)]
    assert torch.frombuffer(blob, dtype=torch.uint8).data_ptr() == staging.data_ptr()
    got, meta = decode(blob)
    _assert_same(got, {k: v.contiguous() for k, v in want.items()})
    with pytest.raises(ValueError, match="at least"):
        encode(want, None, lambda n: torch.zeros(8, dtype=torch.uint8))


@pytest.mark.gpu
def test_encode_from_cuda_into_pinned_staging_matches_the_pageable_payload():
    want = {k: v.cuda() for k, v in _tensors().items()}
    pinned = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    assert bytes(encode(want, None, lambda n: pinned)) == bytes(encode(want))
