"""The executor without MPI: a mailbox link in one process, stages run one after the other
(sends complete at once, as eager MPI sends do), against plain numpy."""

import numpy as np
import pytest

from rlx_mpi.drivers.run import microbatch_bounds
from rlx_mpi.comm.executor import Executor
from rlx_mpi.lifecycle.faults import RankContext
from rlx_mpi.comm.schedule import forward_schedule
from rlx_mpi.comm.wire import get_codec


class MailLink:
    """isend copies the bytes into a mailbox keyed (src, dst, tag); irecv's wait takes them."""

    def __init__(self, box, me):
        self.box, self.me, self.sent = box, me, []

    def isend(self, buf, dest, tag, what):
        self.sent.append(buf)
        self.box.setdefault((self.me, dest, tag), []).append(buf.tobytes())
        return Done(buf)

    def irecv(self, buf, source, tag, what):
        box, me = self.box, self.me

        class Recv(Done):
            def wait(self):
                data = box[(source, me, tag)].pop(0)
                assert len(data) == buf.nbytes, (len(data), buf.nbytes)
                buf.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8)
                return 0.0

        return Recv(buf)


class Done:
    def __init__(self, buf):
        self.buf = buf

    def wait(self):
        return 0.0


def test_microbatch_bounds_uneven():
    assert microbatch_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert microbatch_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert microbatch_bounds(7, 1) == [(0, 7)]


@pytest.mark.parametrize("wire", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("n_stages, batch, M", [(2, 5, 3), (3, 4, 4), (4, 3, 1)])
def test_pipeline_of_affine_stages(wire, n_stages, batch, M):
    rng = np.random.default_rng(0)
    T, C = 3, 8
    x0 = rng.standard_normal((batch, T, C)).astype(np.float32)
    ws = [(rng.standard_normal((C, C)) / np.sqrt(C)).astype(np.float32) for _ in range(n_stages)]
    codec = get_codec(wire)
    bounds = microbatch_bounds(batch, M)
    box, outputs, returned, links = {}, {}, {}, []
    for s in range(n_stages):
        link = MailLink(box, s)
        links.append(link)
        ex = Executor(link, RankContext(rank=s, size=n_stages), rank_of=lambda st: st, codec=codec)

        def compute(m, x, s=s):
            lo, hi = bounds[m]
            h = x0[lo:hi] if s == 0 else x
            assert h.shape == (hi - lo, T, C)
            out = np.tanh(h @ ws[s]) if s % 2 == 0 else h  # odd stages relay their input (an alias)
            outputs[(s, m)] = np.array(out)
            returned[(s, m)] = out
            return out

        ex.run(forward_schedule(s, n_stages, M), compute,
               lambda a: (((bounds[a.microbatch][1] - bounds[a.microbatch][0]), T, C), np.float32))
        assert ex.stats.wall_s > 0 and ex.stats.bytes_sent == (0 if s == n_stages - 1 else x0.nbytes // 4 *
                                                                 codec.itemsize)
    # reference: every hop rounds through the codec
    for m, (lo, hi) in enumerate(bounds):
        h = x0[lo:hi]
        for s in range(n_stages):
            if s > 0:
                h = codec.unpack(codec.pack(np.ascontiguousarray(h, np.float32)), np.empty(h.shape, np.float32))
            h = np.tanh(h @ ws[s]) if s % 2 == 0 else h
            np.testing.assert_allclose(outputs[(s, m)], h, rtol=1e-6, atol=1e-6)
    # f32 is zero copy: stage 0's outputs themselves went on the wire; else packed buffers
    for m in range(M):
        assert (links[0].sent[m] is returned[(0, m)]) == (wire == "f32")


def test_non_float32_payload_goes_raw():
    """Without a float32 payload the codec is bypassed: e.g. int64 tokens on a decode ring."""
    box = {}
    tokens = np.arange(6, dtype=np.int64).reshape(2, 3)
    got = {}
    a = Executor(MailLink(box, 0), RankContext(rank=0, size=2), rank_of=lambda s: s, codec=get_codec("bf16"))
    a.run(forward_schedule(0, 2, 1), lambda m, x: tokens, None)
    b = Executor(MailLink(box, 1), RankContext(rank=1, size=2), rank_of=lambda s: s, codec=get_codec("bf16"))
    b.run(forward_schedule(1, 2, 1), lambda m, x: got.setdefault(m, x.copy()), lambda act: ((2, 3), np.int64))
    np.testing.assert_array_equal(got[0], tokens)


def test_trace_command_bad_input_is_one_line(tmp_path):
    from conftest import run_cli

    bad = tmp_path / "t.json"
    bad.write_text('{"traceEvents": 3}')
    for path in (tmp_path / "missing.json", bad):
        proc = run_cli(["trace", path], timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"rlx-mpi: error: {path}"), proc.stderr
