"""Wire compatibility of gonixl's side channel (package sidechannel) with vLLM.

Uses the real msgspec and pyzmq, vLLM's own NixlHandshakePayload /
NixlAgentMetadata types, listener and handshake functions and hash formula
(vLLM is installed wherever this runs: an import that fails is a failure). The Go side is tests/tools/scpeer, built here with
`go build` unless GONIXL_SCPEER names a built binary.
"""

import hashlib
import json
import os
import pathlib
import random
import shutil
import subprocess
import threading
import types

import msgspec
import pytest
import zmq

import sidechannel_peer as peer
from ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
HASH = "c0ffee" * 10 + "abcd"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def scpeer(tmp_path_factory):
    path = os.environ.get("GONIXL_SCPEER")
    if path:
        return path
    go = shutil.which("go")
    if go is None:
        pytest.fail("the go toolchain is not on PATH and GONIXL_SCPEER is unset")
    out = tmp_path_factory.mktemp("scpeer") / "scpeer"
    subprocess.run([go, "build", "-o", str(out), "./tests/tools/scpeer"], cwd=ROOT, check=True, timeout=600)
    return str(out)


# vLLM is installed wherever these tests run (.venv): an import that fails
# fails the tests that need it.
@pytest.fixture(scope="module")
def vllm_nixl():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    return metadata


@pytest.fixture(scope="module")
def vllm_listener_fn():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    return NixlBaseConnectorScheduler._nixl_handshake_listener


@pytest.fixture(scope="module")
def vllm_handshake_fn():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    return NixlBaseConnectorWorker._nixl_handshake


def run(scpeer, *args, stdin="", check=True):
    p = subprocess.run([scpeer, *args], input=stdin, capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"scpeer {args} failed: {p.stdout} {p.stderr}")
    return p


class GoListener:
    """scpeer serve: a gonixl Listener on 127.0.0.1 serving payloads[(pp, tp)]."""

    def __init__(self, scpeer, tmp_path, payloads, secret=None):
        f = tmp_path / "payloads.txt"
        f.write_text("".join(f"{pp} {tp} {p.hex()}\n" for (pp, tp), p in payloads.items()))
        args = [scpeer, "serve", "-payloads", str(f)] + (["-secret", secret] if secret else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("PORT "), line
        self.port = int(line.split()[1])

    def close(self):
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        assert self.proc.wait(timeout=30) == 0
        return out  # "SERVED n REFUSED m"


@pytest.fixture
def go_listener(scpeer, tmp_path):
    made = []

    def make(payloads, secret=None):
        l = GoListener(scpeer, tmp_path, payloads, secret)
        made.append(l)
        return l

    yield make
    for l in made:
        if l.proc.poll() is None:
            l.close()


# ---------------------------------------------------------------- metadata

FULL = dict(
    engine_id="prefill-0",
    agent_metadata=bytes(range(256)) * 3,
    kv_caches_base_addr=[0x7F0000001000, 2**63 + 5, 0],
    device_id=3,
    num_blocks=70000,
    block_lens=[4096, 128, 2**33],
    block_strides=[-1, -200, -(2**40), 0],
    kv_cache_layout="NHD",
    block_size=16,
    ssm_sizes=(5, 2**31),
    attn_backend_name="FLASH_ATTN",
    physical_blocks_per_logical_kv_block=2,
    region_num_blocks=[10, 20],
    region_group_ids=[],
    region_names=["a", "ü" * 40],
    region_mem_types=["VRAM", "DRAM"],
    dcp_size=2,
    pcp_size=4,
    ple_block_len=512,
    region_members=[["l0", "l1"], []],
    packed_member_layouts={"z": (0, 64), "a": (64, 4096)},
)
REQUIRED = {k: FULL[k] for k in list(FULL)[:12]}
CASES = {"every-field": FULL, "required-only": REQUIRED}


def go_json(meta):
    """The JSON form scpeer reads and writes (see tests/tools/scpeer)."""
    m = dict(FULL_DEFAULTS, **meta)
    return dict(
        m,
        agent_metadata=m["agent_metadata"].hex(),
        kv_caches_base_addr=[str(a) for a in m["kv_caches_base_addr"]],
        ssm_sizes=list(m["ssm_sizes"]),
        packed_member_layouts={k: list(v) for k, v in m["packed_member_layouts"].items()},
    )


FULL_DEFAULTS = dict(
    region_num_blocks=None, region_group_ids=None, region_names=None, region_mem_types=None,
    dcp_size=1, pcp_size=1, ple_block_len=None, region_members=[], packed_member_layouts={},
)


def go_encode(scpeer, meta, hash_=HASH):
    j = go_json(meta)
    j["packed_member_layouts"] = [[k, *v] for k, v in meta.get("packed_member_layouts", {}).items()]
    return bytes.fromhex(run(scpeer, "encode", stdin=json.dumps({"hash": hash_, "metadata": j})).stdout.strip())


def vllm_payload(nm, meta, hash_=HASH):
    enc = msgspec.msgpack.Encoder()
    return enc.encode(nm.NixlHandshakePayload(compatibility_hash=hash_, agent_metadata_bytes=enc.encode(nm.NixlAgentMetadata(**meta))))


def test_installed_connector_version(vllm_nixl):
    # sidechannel.NIXLConnectorVersion and its field set follow this version.
    assert vllm_nixl.NIXL_CONNECTOR_VERSION == 14
    fields = list(vllm_nixl.NixlAgentMetadata.__dataclass_fields__)
    assert fields == list(FULL), fields


@pytest.mark.parametrize("case", CASES)
def test_vllm_decodes_gonixl_payload(scpeer, vllm_nixl, case):
    meta = CASES[case]
    got = go_encode(scpeer, meta)
    payload = msgspec.msgpack.Decoder(vllm_nixl.NixlHandshakePayload).decode(got)
    assert payload.compatibility_hash == HASH
    decoded = msgspec.msgpack.Decoder(vllm_nixl.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    assert decoded == vllm_nixl.NixlAgentMetadata(**meta)
    # Byte for byte what vLLM's own encoder produces.
    assert got == vllm_payload(vllm_nixl, meta)


@pytest.mark.parametrize("case", CASES)
def test_gonixl_decodes_vllm_payload(scpeer, vllm_nixl, case):
    meta = CASES[case]
    out = json.loads(run(scpeer, "decode", stdin=vllm_payload(vllm_nixl, meta).hex()).stdout)
    assert out["hash"] == HASH
    assert out["metadata"] == json.loads(json.dumps(go_json(meta)))


def _mutations(rng, blob, n):
    """Byte-level mutations: flips, truncation, insertion, deletion."""
    for _ in range(n):
        b = bytearray(blob)
        op = rng.randrange(4)
        i = rng.randrange(len(b))
        if op == 0:
            b[i] = rng.randrange(256)
        elif op == 1:
            del b[i:]
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        else:
            del b[i : i + rng.randrange(1, 4)]
        yield bytes(b)


def _structural(rng, nm, n):
    """Typed mutations: drop, add or retype one field of the metadata map."""
    values = [None, True, 0, -1, 7, 1.5, "s", b"b", [], [1], ["x"], [[]], [1, 2], {}, {"k": [1, 2]}, {"k": [1]}, {1: [1, 2]}]
    base = {k: v for k, v in FULL.items()}
    for _ in range(n):
        d = dict(base)
        key = rng.choice(list(d) + ["unknown_key"])
        op = rng.randrange(3)
        if op == 0:
            d.pop(key, None)
        else:
            d[key] = rng.choice(values)
        yield msgspec.msgpack.encode(d)


def _msgspec_accepts(decoder, b):
    try:
        decoder.decode(b)
        return True
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return False


# Documented differences: Go holds integers as int64 (addresses as uint64), so
# integers msgspec accepts beyond that range are rejected.
RANGE_ERRORS = ("does not fit in int64", "is negative")


def test_decoders_accept_exactly_what_msgspec_accepts(scpeer, vllm_nixl):
    rng = random.Random(1234)
    enc = msgspec.msgpack.Encoder()
    meta_blob = enc.encode(vllm_nixl.NixlAgentMetadata(**FULL))
    payload_blob = vllm_payload(vllm_nixl, REQUIRED)
    inputs = [("metadata", b) for b in _mutations(rng, meta_blob, 1500)]
    inputs += [("metadata", b) for b in _structural(rng, vllm_nixl, 1500)]
    inputs += [("payload", b) for b in _mutations(rng, payload_blob, 1000)]
    decoders = {
        "metadata": msgspec.msgpack.Decoder(vllm_nixl.NixlAgentMetadata),
        "payload": msgspec.msgpack.Decoder(vllm_nixl.NixlHandshakePayload),
    }
    out = run(scpeer, "decode-many", stdin="".join(f"{k} {b.hex()}\n" for k, b in inputs)).stdout.splitlines()
    assert len(out) == len(inputs)
    mismatches = []
    accepted = 0
    for (kind, b), go in zip(inputs, out):
        py_ok = _msgspec_accepts(decoders[kind], b)
        go_ok = go == "ok"
        accepted += go_ok
        if py_ok != go_ok and not (py_ok and any(e in go for e in RANGE_ERRORS)):
            mismatches.append((kind, b.hex(), py_ok, go))
    assert not mismatches, f"{len(mismatches)} disagreements, first: {mismatches[:3]}"
    print(f"differential: {len(inputs)} inputs, {accepted} accepted by both")
    assert 0 < accepted < len(inputs)  # the corpus exercises both outcomes


def test_hash_factors_match_python(scpeer):
    rng = random.Random(99)
    alphabet = ["a", "Z", " ", '"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "\u2028", "中", "😀", "/"]

    def rstr():
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(8)))

    def rval(depth=0):
        choices = [None, True, False, rng.randrange(-(2**40), 2**40), rstr()]
        if depth < 2:
            choices += [[rval(depth + 1) for _ in range(rng.randrange(3))], {rstr(): rval(depth + 1) for _ in range(rng.randrange(3))}]
        return rng.choice(choices)

    from vllm.config.utils import hash_factors  # vLLM's own formula (installed: no fallback copy)

    for _ in range(100):
        factors = {rstr(): rval() for _ in range(rng.randrange(1, 8))}
        assert run(scpeer, "hash", stdin=json.dumps(factors)).stdout.strip() == hash_factors(factors), factors


@pytest.mark.parametrize("kind", ["", "nixl", "ucx"])
def test_engine_kind_factor(scpeer, kind):
    factors = {"vllm_version": "0.32.0", "nixl_connector_version": 14, "transfer_mode": "pull"}
    expected = dict(factors, gonixl_transfer_engine=kind) if kind == "ucx" else factors
    want = hashlib.sha256(json.dumps(expected, sort_keys=True).encode()).hexdigest()
    got = subprocess.run([scpeer, "hash"], input=json.dumps(factors), capture_output=True, text=True,
                         env=dict(os.environ, SCPEER_ENGINE_KIND=kind), check=True).stdout.strip()
    assert got == want


def _fake_vllm_config(spec=None):
    ns = types.SimpleNamespace
    model = ns(model="Qwen/Qwen3-0.6B", dtype="torch.bfloat16", get_total_num_kv_heads=lambda: 8,
               get_head_size=lambda: 128, get_total_num_hidden_layers=lambda: 28)
    return ns(model_config=model, cache_config=ns(cache_dtype="auto"),
              scheduler_config=ns(disable_hybrid_kv_cache_manager=False), speculative_config=spec)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("speculative", [False, True])
def test_compat_hash_matches_vllm_function(scpeer, vllm_nixl, mode, speculative):
    """vLLM's own compute_nixl_compatibility_hash against sidechannel.CompatibilityHash."""
    import vllm

    spec, go_spec = None, None
    if speculative:
        ns = types.SimpleNamespace
        draft = ns(model="eagle-draft", revision=None, code_revision="main",
                   hf_config=ns(eagle_aux_hidden_state_layer_ids=[1, 5, 9]))
        spec = ns(use_eagle=lambda: True, draft_model_config=draft, method="eagle3", parallel_drafting=True, kv_cache_dtype=None)
        go_spec = {"Method": "eagle3", "Model": "eagle-draft", "Revision": None, "CodeRevision": "main",
                   "ParallelDrafting": True, "KVCacheDType": "auto", "AuxiliaryLayerIDs": [1, 5, 9]}
    want = vllm_nixl.compute_nixl_compatibility_hash(_fake_vllm_config(spec), "CPU_ATTN", transfer_mode=mode)
    factors = {"VLLMVersion": vllm.__version__, "Model": "Qwen/Qwen3-0.6B", "DType": "torch.bfloat16", "NumKVHeads": 8,
               "HeadSize": 128, "NumHiddenLayers": 28, "AttnBackendName": "CPU_ATTN", "CacheDType": "auto",
               "IsHMAEnabled": True, "Speculative": go_spec, "TransferMode": mode, "TransferEngine": "nixl"}
    assert run(scpeer, "compat", stdin=json.dumps(factors)).stdout.strip() == want


# ---------------------------------------------------------------- ZMQ both ways


def payloads_for(nm_or_none, engine, ranks):
    out = {}
    for pp, tp in ranks:
        meta = dict(REQUIRED, engine_id=engine, device_id=tp)
        if nm_or_none is not None:
            out[(pp, tp)] = vllm_payload(nm_or_none, meta)
    return out


def test_python_client_against_go_listener(scpeer, go_listener, vllm_nixl):
    ranks = [(0, 0), (0, 1), (1, 0)]
    l = go_listener(payloads_for(vllm_nixl, "engine-P", ranks))
    replies = peer.query("127.0.0.1", l.port, ranks)
    dec_p = msgspec.msgpack.Decoder(vllm_nixl.NixlHandshakePayload)
    dec_m = msgspec.msgpack.Decoder(vllm_nixl.NixlAgentMetadata)
    for (pp, tp), (parts, _rtt) in zip(ranks, replies):
        assert len(parts) == 2
        assert parts[1][0] == 0xCB and isinstance(msgspec.msgpack.decode(parts[1]), float)
        m = dec_m.decode(dec_p.decode(parts[0]).agent_metadata_bytes)
        assert (m.engine_id, m.device_id) == ("engine-P", tp)
    # Bad requests are answered (vLLM's own listener thread would die here)
    # and the listener keeps serving.
    for frames in ([b"\xc1"], [msgspec.msgpack.encode((b"get_meta_msg", 0))], [msgspec.msgpack.encode((b"get_meta_msg", 0, 9))]):
        reply = peer.send_raw("127.0.0.1", l.port, frames)
        assert dec_p.decode(reply[0]).compatibility_hash.startswith("gonixl-side-channel-error: ")
    assert len(peer.query("127.0.0.1", l.port, [(0, 0)])[0][0]) == 2
    assert l.close().split() == ["SERVED", "4", "REFUSED", "3"]


def fake_worker(nm, compat_hash, targets, enforce=True):
    """The state vLLM's NixlBaseConnectorWorker._nixl_handshake reads."""
    added = {}

    def add_remote_agent(metadata, remote_rank, remote_tp_size, dcp_size=1):
        added[remote_rank] = metadata
        return f"agent-{remote_rank}"

    w = types.SimpleNamespace(
        _is_csa_linear=False,
        use_host_buffer=True,  # skips current_platform.set_device
        transfer_topo=types.SimpleNamespace(handshake_target_ranks=lambda tp, dcp=1: targets),
        compat_hash=compat_hash,
        enforce_compat_hash=enforce,
        _validate_remote_parallel_config=lambda m: None,
        add_remote_agent=add_remote_agent,
    )
    return w, added


def test_vllm_handshake_against_go_listener(scpeer, go_listener, vllm_nixl, vllm_handshake_fn):
    l = go_listener(payloads_for(vllm_nixl, "engine-P", [(0, 0), (0, 1)]))
    w, added = fake_worker(vllm_nixl, HASH, [0, 1])
    agents, offset = vllm_handshake_fn(w, "127.0.0.1", l.port, 2, "engine-P")
    assert agents == {(0, 0): "agent-0", (0, 1): "agent-1"}
    assert added[1].device_id == 1 and isinstance(offset, float)
    # vLLM checks the hash first, naming both.
    w, _ = fake_worker(vllm_nixl, "other-hash", [0])
    with pytest.raises(RuntimeError, match=f"Local: other-hash, Remote: {HASH}"):
        vllm_handshake_fn(w, "127.0.0.1", l.port, 1, "engine-P")


def test_stock_vllm_client_against_authenticated_go_listener(scpeer, go_listener, vllm_nixl, vllm_handshake_fn):
    l = go_listener(payloads_for(vllm_nixl, "engine-P", [(0, 0)]), secret="s3cret")
    w, _ = fake_worker(vllm_nixl, HASH, [0])
    with pytest.raises(RuntimeError, match="gonixl-side-channel-error: auth-required: this listener requires side-channel authentication"):
        vllm_handshake_fn(w, "127.0.0.1", l.port, 1, "engine-P")
    # A gonixl client with the same secret succeeds; with another it is told why it failed.
    ok = json.loads(run(scpeer, "fetch", "-port", str(l.port), "-engine", "engine-P", "-hash", HASH, "-secret", "s3cret").stdout)
    assert ok["agents"]["0:0"]["engine_id"] == "engine-P"
    bad = run(scpeer, "fetch", "-port", str(l.port), "-engine", "engine-P", "-hash", HASH, "-secret", "other", check=False)
    assert bad.returncode == 1 and "secrets differ" in json.loads(bad.stdout)["error"]


@pytest.fixture
def vllm_listener(vllm_listener_fn):
    """vLLM's own _nixl_handshake_listener on a thread."""
    started = []

    def start(encoded):
        port = free_port()
        ready, stop = threading.Event(), threading.Event()
        t = threading.Thread(target=vllm_listener_fn, args=(encoded, ready, stop, "127.0.0.1", port), daemon=True)
        t.start()
        assert ready.wait(10)
        started.append((t, stop))
        return port, t

    yield start
    for t, stop in started:
        stop.set()
        t.join(timeout=10)


def test_go_client_against_vllm_listener(scpeer, vllm_nixl, vllm_listener):
    ranks = [(0, 0), (0, 1), (1, 1)]
    port, thread = vllm_listener(payloads_for(vllm_nixl, "engine-P", ranks))
    out = json.loads(run(scpeer, "fetch", "-port", str(port), "-engine", "engine-P", "-hash", HASH, "-ranks", "0:0,0:1,1:1").stdout)
    assert sorted(out["agents"]) == ["0:0", "0:1", "1:1"]
    assert out["agents"]["1:1"]["device_id"] == 1
    assert isinstance(out["clock_offset"], float)
    # Hash mismatch names both hashes; enforce_handshake_compat=false lets it through.
    bad = run(scpeer, "fetch", "-port", str(port), "-engine", "engine-P", "-hash", "mine", check=False)
    err = json.loads(bad.stdout)["error"]
    assert bad.returncode == 1 and f"Local: mine, Remote: {HASH}" in err
    run(scpeer, "fetch", "-port", str(port), "-engine", "engine-P", "-hash", "mine", "-allow-mismatch")
    # A gonixl client with a secret refuses the stock listener's unauthenticated
    # reply, and the stock listener survives the authenticated request.
    auth = run(scpeer, "fetch", "-port", str(port), "-engine", "engine-P", "-hash", HASH, "-secret", "s", check=False)
    assert auth.returncode == 1 and "listener has no side-channel secret configured" in json.loads(auth.stdout)["error"]
    assert thread.is_alive()
    run(scpeer, "fetch", "-port", str(port), "-engine", "engine-P", "-hash", HASH)


def test_go_client_against_python_listener(scpeer, vllm_nixl):
    """The hand-written Python peer (no vLLM code) as the listener."""
    port = free_port()
    l = peer.Listener("127.0.0.1", port, payloads_for(vllm_nixl, "engine-Q", [(0, 0)]))
    try:
        out = json.loads(run(scpeer, "fetch", "-port", str(port), "-engine", "engine-Q", "-hash", HASH).stdout)
        assert out["agents"]["0:0"]["engine_id"] == "engine-Q"
        wrong = run(scpeer, "fetch", "-port", str(port), "-engine", "engine-X", "-hash", HASH, check=False)
        assert wrong.returncode == 1 and "engine ID mismatch" in json.loads(wrong.stdout)["error"]
    finally:
        l.close()
