// Package sidechannel speaks vLLM's NIXL side-channel handshake, byte for
// byte, so that a gonixl engine and a stock vLLM NixlConnector can exchange
// agent metadata with each other.
//
// # Protocol (NIXL connector version 14, vLLM 0.32)
//
// The scheduler process of an engine runs one Listener on
// VLLM_NIXL_SIDE_CHANNEL_HOST : VLLM_NIXL_SIDE_CHANNEL_PORT + data-parallel
// index (ZeroMQ ROUTER). A decode worker's Client connects a REQ socket and,
// for each target (pp_rank, tp_rank), sends msgpack (b"get_meta_msg", pp, tp)
// and receives two frames: the msgspec encoding of NixlHandshakePayload
// {compatibility_hash, agent_metadata_bytes} and a msgpack float64 of the
// listener's clock. The client keeps the clock offset of the lowest-RTT
// sample, checks the compatibility hash before it decodes the
// NixlAgentMetadata inside (two-phase decoding), then checks the engine id.
//
// Encodings follow msgspec: maps keyed by field name in declaration order,
// bytes as bin, tuples as arrays, None as nil, the smallest integer width;
// decoding ignores unknown keys, fills defaults for absent optional fields and
// fails on missing required fields, wrong types and trailing bytes.
// NIXL's own agent blob (AgentMetadata.AgentMetadata) is opaque here.
//
// The compatibility hash is vLLM's (CompatibilityHash, HashFactors). gonixl
// adds its transfer-engine kind as the factor "gonixl_transfer_engine" only
// when the kind is not "nixl": an engine built on NIXL hashes exactly as
// stock vLLM and interoperates with it, while an engine whose agent metadata
// is not a NIXL blob (e.g. "ucx") fails the hash check against either.
//
// # Differences from vLLM's own listener
//
//   - A malformed request, an unknown rank or a rank whose payload is not
//     set yet is answered with an error reply instead of killing the
//     listener thread. An error reply is a NixlHandshakePayload whose hash is
//     "gonixl-side-channel-error: <code>: <message>" with empty metadata, so
//     a stock vLLM client fails its hash check naming the reason. A gonixl
//     client retries "not-ready" until its deadline.
//   - Frames above MaxFrameSize (default 16 MiB) are refused before any
//     allocation; connections are capped and have handshake and idle
//     deadlines.
//   - The ZeroMQ layer is a small ZMTP 3.1 (NULL mechanism) implementation
//     in this package (zmtp.go), tested against libzmq through pyzmq and
//     vLLM's own listener and handshake code. It is used instead of
//     github.com/go-zeromq/zmq4 v0.17.0 because that library allocates a frame
//     of whatever size the peer announces before reading it (no way to
//     enforce MaxFrameSize), and runs each peer's ZMTP greeting inside its
//     accept loop without a deadline: one TCP peer that connects and stays
//     silent blocks every later peer (reproduced with a pyzmq REQ client).
//   - Optional shared-secret authentication (auth.go): HMAC-SHA256 over
//     request and reply. With no secret the wire bytes are exactly vLLM's.
//     A secret on one side only fails the handshake with a message that says
//     which side lacks it.
//
// # KV digest query (gonixl only)
//
// A decode engine that keeps a finished request's KV blocks for a later
// reader also serves, on the same listener, the digests of those blocks by
// request id. Stock vLLM never sends or answers this message. The listener
// tells the kinds apart by the request: an array whose first element is a
// bin/str starting with "gonixl_kv_digest", or any 2-element array not
// tagged "get_meta_msg", is a digest query; everything else goes down the
// handshake path, unchanged.
//
// Request: msgpack [tag, request_id], tag b"gonixl_kv_digest" (str also
// accepted), request_id a str of 1..1024 bytes, nothing else. Reply, after
// the REQ delimiter: one frame, msgpack {"status", "message", "digest"}.
// "ok": digest holds the bytes; "pending": the engine holds the request but
// its digest is not in yet, ask again; "none": nothing to serve (unknown
// request or no digests taken), not an error; "error": message is
// "<code>: <reason>" (the handshake's codes plus "provider-failed"). With a
// secret the tag carries nonce and MAC as the handshake's does, under its
// own MAC domain, and a reply to a verified query gets a second frame, the
// MAC of the body bound to the request MAC (auth.go). Refusals of
// unverified or malformed queries are one frame.
//
// ListenerConfig.KVDigest supplies the digests (nil: always "none").
// Client.KVDigest fetches one, polling "pending" every 20 ms until its
// context ends, on a new connection each time (a waiting reader holds none
// of the listener's MaxConns slots between polls).
//
// # API
//
// Scheduler side: NewListener(ListenerConfig), Listener.SetPayload(pp, tp,
// HandshakePayload.Encode()), Listener.Stop. Worker side:
// NewClient(ClientConfig), Client.Start (returns a Future) or Client.Handshake
// (blocking), Client.Close. Compatibility hash: CompatibilityHash(values) or
// HashFactorsJSON(json.dumps(factors), engineKind). Wire types:
// HandshakePayload, AgentMetadata and their Encode/Decode functions. KV
// digest query: ListenerConfig.KVDigest, Client.KVDigest,
// EncodeKVDigestRequest/DecodeKVDigestRequest, KVDigestReply and
// DecodeKVDigestReply.
// Configuration comes in as plain structs;
// FromEnv(os.Getenv) and ResolveSecret are the only readers of environment
// variables.
//
// # Imports
//
// The standard library and go.uber.org/zap only (the layering rule also
// allows msgpack/v5, which the tests use as an independent decoder). It never imports nixl, shim, capi or proxy.
//
// # Concurrency
//
// Listener and Client are safe for concurrent use. A Listener serves every
// connection on its own goroutine; Stop closes all of them and waits, and is
// idempotent. A Client runs each handshake on its own goroutine, bounded by
// ClientConfig.Timeout; concurrent Start calls for the same engine, address
// and ranks share one handshake and one immutable *Result. Client.KVDigest
// runs on its caller's goroutine with its own connection, and the listener
// calls ListenerConfig.KVDigest on connection goroutines, concurrently and
// with no lock held. Encode and Decode functions are pure.
package sidechannel
