"""Files pipesched reads are UTF-8 whatever the locale, and a leading byte order mark (some editors write one) is
skipped: a torch schedule CSV and a layer profile here (programs and timelines: test_program_io_bom_and_bare_json.py)."""
import warnings

from pipesched.interop import TorchCsvWarning, from_torch_csv, to_torch_csv
from pipesched.profile import LayerProfile

CSV = "0F0,0SEND_F0,0RECV_B0,0B0\r\n1RECV_F0,1F0,1B0,1SEND_B0\r\n"


def _read(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)
        return from_torch_csv(path)


def test_a_torch_csv_with_a_byte_order_mark_reads_as_without(tmp_path):
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    plain.write_bytes(CSV.encode())
    marked.write_bytes(b"\xef\xbb\xbf" + CSV.encode())
    program = _read(marked)
    assert program == _read(plain)
    assert program.num_stages == 2 and program.num_microbatches == 1


def test_a_written_torch_csv_is_utf8_and_reads_back(tmp_path):
    program = _read_plain(tmp_path)
    out = tmp_path / "out.csv"
    to_torch_csv(program, out)
    out.read_bytes().decode("utf-8")  # raises if not UTF-8
    assert _read(out) == program


def _read_plain(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes(CSV.encode())
    return _read(path)


def test_a_profile_with_a_byte_order_mark_loads_as_without(tmp_path):
    profile = LayerProfile(forward=(1.0, 2.0), input_grad=(0.5, 1.0), weight_grad=(0.0, 1.0),
                           activation_bytes=(10.0, 20.0), output_bytes=(4.0, 8.0), param_bytes=(0.0, 100.0),
                           microbatch_size=2, input_bytes=6.0, latency=0.25, bandwidth=1000.0,
                           layer_names=("Linear", "Linear"))
    path = tmp_path / "profile.json"
    profile.save(path)
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert LayerProfile.load(marked) == profile == LayerProfile.load(path)
