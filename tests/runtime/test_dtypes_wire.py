"""Every dtype torch can hold crosses a stage boundary (trial D, finding 1): the ones gloo/NCCL cannot send travel
as their bytes, in both directions and in the meta header; quantized tensors are refused before any message.
One launch of 2 gloo ranks runs every multi-process case (rt_dtypes_wire.suite); packing is tested in this process."""
import pytest
import torch

from pipesched.runtime import launch
from pipesched.runtime.wire import (DTYPE_CODE, DTYPE_NAMES, DTYPES, NATIVE_DTYPES, decode_meta, empty_for,
                                    encode_meta, meta_of, pack, unpack)
from pipesched.runtime.handshake import encode_signature

import rt_dtypes_wire
from rt_dtypes_wire import CASES, STEPS, USED, bits_of


@pytest.fixture(scope="module")
def ranks():
    return launch(rt_dtypes_wire.suite, 2, timeout=400)


# ---- 2 ranks ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt_name, schedule, kind", CASES)
def test_step_is_bitwise_the_unsplit_model(ranks, dt_name, schedule, kind):
    """Each step's loss on both ranks equals the unsplit model's, bitwise, and every rank's parameter gradients are
    bitwise equal, None where the unsplit model's is (lin1 under an integer ``used``). Rank 0's lin1 gradient came
    back as ``used``'s gradient, of ``dt_name`` (float8, complex32...)."""
    floating = getattr(torch, dt_name).is_floating_point or getattr(torch, dt_name).is_complex
    for rank, results in enumerate(ranks):
        for k, step in enumerate(results[(dt_name, schedule, kind)]["steps"]):
            assert step["loss"].dtype == torch.float32 and torch.equal(step["loss"], step["ref"]), (rank, k, step)
            lin0 = "none" if kind == "single" else "equal"  # a single output is `used` alone: h unused
            names = {"lin0.weight": lin0, "lin0.bias": lin0, "lin1.weight": "none", "lin1.bias": "none"}
            if dt_name in USED and floating:
                names.update({"lin1.weight": "equal", "lin1.bias": "equal"})
            want = ({f"0.{n}": v for n, v in names.items()} if rank == 0 else {"1.lin.weight": "equal",
                                                                               "1.lin.bias": "equal"})
            assert step["grads"] == want, (rank, k, step)
        assert len(results[(dt_name, schedule, kind)]["steps"]) == STEPS


@pytest.mark.parametrize("dt_name, schedule, kind", CASES)
def test_stage_1_receives_the_values_bitwise(ranks, dt_name, schedule, kind):
    """What stage 1 received on rank 1, per call (STEPS steps x 3 microbatches, then 2 forwards x 3): the same dtypes,
    shapes and bits (raw bytes of x: NaNs and invalid codes included; the 0-dim element) as the unsplit model saw."""
    dt = getattr(torch, dt_name)
    seen, ref_seen = ranks[1][(dt_name, schedule, kind)]["seen"], ranks[1][(dt_name, schedule, kind)]["ref_seen"]
    assert len(seen) == len(ref_seen) == (STEPS + 2) * 3
    for call, (got, want) in enumerate(zip(seen, ref_seen)):
        assert [(d, s) for d, s, _ in got] == [(d, s) for d, s, _ in want], call
        assert all(d == dt for d, _, _ in got), call
        assert kind == "single" or got[-1][1] == (), call  # the 0-dim element stays 0-dim
        for (_, _, a), (_, _, b) in zip(got, want):
            assert torch.equal(a, b), (call, a, b)
    assert len(seen[0]) == (1 if kind == "single" else 3 if dt_name in USED else 2)


@pytest.mark.parametrize("dt_name, schedule, kind", CASES)
def test_forward_is_the_unsplit_model(ranks, dt_name, schedule, kind):
    """forward(), learning then learned: the last stage's rank returns the unsplit output bitwise, rank 0 None."""
    for k in range(2):
        assert ranks[0][(dt_name, schedule, kind)]["forwards"][k]["got"] is None
        fwd = ranks[1][(dt_name, schedule, kind)]["forwards"][k]
        assert torch.equal(fwd["got"], fwd["ref"]), (k, fwd)


def test_a_quantized_stage_output_is_refused_before_any_message(ranks):
    """Rank 0 fails at F0.0 (the forward, before SEND_F0.0) naming the element and the stage; rank 1 names rank 0's
    failure; both quote the reason and the remedy."""
    for rank, message in enumerate([ranks[0]["quantized"], ranks[1]["quantized"]]):
        assert "world rank 0 (pipeline rank 0) failed at instruction F0.0" in message, (rank, message)
        assert ("element 1 of the output of stage 0: a quantized tensor (dtype torch.qint8) cannot cross a stage "
                "boundary: its scale and zero point are not in its bytes; dequantize() it first") in message, message


# ---- one process: packing --------------------------------------------------------------------------------------

def _every_dtype():
    return [dt for dt in DTYPES if dt is not None]


def _random_bytes(shape, dt, seed):
    n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dt == torch.bool:
        raw = raw % 2  # a bool byte is 0 or 1
    return raw.view(dt).view(shape)


def test_the_wire_codes_are_fixed():
    """The first 12 codes are those of before (a peer running an older pipesched decodes them the same); every
    dtype torch 2.13 can hold but the quantized ones has a code."""
    assert DTYPE_NAMES[:12] == ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                                "uint8", "bool", "complex64", "complex128")
    every = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    quantized = {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    assert every - quantized <= set(DTYPE_CODE), every - quantized - set(DTYPE_CODE)
    assert not quantized & set(DTYPE_CODE)


@pytest.mark.parametrize("dt", _every_dtype(), ids=str)
def test_every_dtype_packs_and_unpacks_bitwise(dt):
    """Alone and in a tuple; contiguous, transposed, strided, 0-dim (with a storage offset), empty: the receiver's
    buffer has the sender's size and unpacks to the same dtype, shape and bits; the meta header round-trips."""
    base = _random_bytes((6, 4), dt, seed=DTYPE_CODE[dt])
    shapes = [base, base.t(), base[::2, 1:], base[3, 2], base[:0]]
    for t in shapes:
        for tensors in ((t,), (torch.ones(3), t, t)):
            meta = meta_of(tensors, len(tensors) > 1)
            assert decode_meta(encode_meta(meta)) == meta
            specs = [(s, d) for s, d, _ in meta[1]]
            wire = pack(tensors)
            assert empty_for(specs, "cpu").shape == wire.shape and empty_for(specs, "cpu").dtype == wire.dtype
            back = unpack(wire.clone(), specs)
            assert [(b.dtype, b.shape) for b in back] == [(a.dtype, a.shape) for a in tensors]
            assert all(torch.equal(bits_of(a), bits_of(b)) for a, b in zip(tensors, back))
            if len(tensors) == 1 and dt not in NATIVE_DTYPES:
                assert wire.dtype == torch.uint8


@pytest.mark.parametrize("dt", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
                                torch.int16, torch.complex64], ids=str)
def test_a_single_tensor_of_a_dtype_nccl_cannot_send_goes_as_bytes(dt):
    """torch's NCCL sends no uint16/32/64, int16 or complex (float8: bytes too, whatever the NCCL version): alone,
    such a tensor is a uint8 message (gloo sends any dtype's bytes, so only this check sees it on CPU)."""
    t = _random_bytes((3, 2), dt, seed=1)
    assert pack((t,)).dtype == torch.uint8 and empty_for([((3, 2), dt)], "cpu").dtype == torch.uint8


def test_conjugate_and_negative_views_travel_as_their_values():
    """x.conj() and x.conj().imag are views whose storage does not hold their values: the values travel."""
    c = torch.complex(torch.arange(6.).reshape(3, 2), torch.arange(6.).reshape(3, 2) + 10)
    for t in (c.conj(), c.conj().t(), c.conj().imag, c.conj().imag[1, 1], c.conj()[0, 0]):
        assert t.is_conj() or t.is_neg()
        spec = [(tuple(t.shape), t.dtype)]
        (back,) = unpack(pack((t,)), spec)
        assert torch.equal(back, t.resolve_conj().resolve_neg()), t
        back = unpack(pack((torch.ones(2), t)), [((2,), torch.float32)] + spec)[1]
        assert torch.equal(back, t.resolve_conj().resolve_neg()), t


def test_an_input_of_any_dtype_has_a_signature():
    """x of a dtype that travels as bytes (uint16, float8) is described; a quantized one is refused, naming why."""
    x = (torch.zeros(4, 3, dtype=torch.uint16), torch.zeros(4, dtype=torch.float8_e5m2))
    words = encode_signature(True, 2, [tuple(t[:2] for t in x), tuple(t[2:] for t in x)], True)
    assert words[6:11] == [DTYPE_CODE[torch.uint16], 1, 3, DTYPE_CODE[torch.float8_e5m2], 0]
    q = torch.quantize_per_tensor(torch.zeros(4, 3), 0.1, 0, torch.quint8)
    with pytest.raises(TypeError, match=r"x: a quantized tensor \(dtype torch.quint8\) cannot cross a stage boundary"):
        encode_signature(True, 1, [(q,)], False)
