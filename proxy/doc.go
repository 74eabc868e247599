// Package proxy implements gonixl's two prefill/decode (P/D) HTTP proxies,
// behaviour-compatible with the two Python proxies vLLM ships:
//
//   - the toy proxy (vLLM's tests/v1/kv_connector/nixl_integration/
//     toy_proxy_server.py): every OpenAI completion request is first sent to a
//     prefill instance as a one-token, non-streaming request carrying
//     kv_transfer_params{do_remote_decode: true}; the parameters the prefill
//     instance returns are then attached to the client's request, which goes to
//     a decode instance whose response body is relayed unchanged (server-sent
//     events are flushed as they arrive);
//   - the multi-turn proxy (vLLM's examples/disaggregated/
//     disaggregated_serving/disagg_proxy_multiturn.py): in addition, the
//     decode instance's final kv_transfer_params are cached per
//     conversation_id (single use, the decodes' decoder_kv_blocks_ttl: 480 s
//     by default) and handed to the prefill instance on the conversation's
//     next turn, so that the prefill instance pulls the decode instance's
//     blocks (bidirectional KV transfer).
//
// The multi-turn state lives behind StateStore (state.go: its rules — single
// use, turn order, lifetime, no leakage): in this process by default
// (ConversationCache), or in Redis/Valkey (proxy/redisstate) so that several
// proxy replicas share conversations and a restarted one forgets none. A
// shared store's calls are bounded (Config.StateTimeout, 50 ms); one that
// fails or times out makes the turn a full prefill, logged and counted
// (gonixl_proxy_state_store_errors_total), never a client error.
//
// Prefill and decode instances are chosen by two independent round robins.
// Both modes serve GET /healthcheck (toy format), GET /health (multi-turn
// format, also evicts stale cache entries) and GET /metrics (the proxy's own
// Prometheus registry).
//
// Errors: an unreachable, failing (5xx) or silent upstream gives the client a
// 502 or 504 with an OpenAI-style JSON error body; a 4xx from an upstream is
// relayed as is (it is the client's error). A client that disconnects cancels
// the upstream requests through the request context.
//
// Where it differs from the reference proxies, on purpose:
//   - a client's own X-Request-Id is forwarded (the reference always makes a
//     new UUID; one is made here when the client sends none);
//   - every answer carries "Server-Timing: prefill;dur=<ms>", the prefill
//     leg (request sent to its answer read), so that a client can tell the
//     prefill's share of a response time (gonixl-bench multiturn reports it
//     per turn);
//   - without OPENAI_API_KEY no "Bearer None" is sent: the client's own
//     Authorization header, if any, is forwarded;
//   - the toy proxy answers with the decode instance's Content-Type
//     (text/event-stream for streams), not always application/json;
//   - upstream failures become 502/504 JSON errors, and upstream 4xx answers
//     are relayed, instead of a 500 or a broken stream;
//   - a client's own kv_transfer_params never reach a decode instance
//     (Config.ForwardClientKVParams, --forward-client-kv-params, restores the
//     reference's forwarding): they name remote engines, addresses and block
//     ids, and a client must not be able to point a decode at them;
//   - idle upstream connections are kept 4 s (Config.UpstreamIdleTimeout),
//     below vLLM's 5 s keep-alive, so a connection the server is closing is
//     never reused (httpx's 5 s pool expiry raced it);
//   - --reuse-mode oneway (from a later revision of the multi-turn proxy that
//     the stored sources lack) is read as "never cache": every turn misses;
//   - the multi-turn proxy sends a non-streaming turn to the decode instance
//     non-streaming (the reference always streams it): vLLM 0.32 returns
//     kv_transfer_params only in a non-streaming body, its stream chunks have
//     no such field, so a streamed decode never brought them back. The
//     decode's body is relayed (with its usage) without the params;
//   - the in-process conversation cache is bounded (Config.MaxConversations);
//   - of two turns of one conversation in flight at once, the params of the
//     one that started later are kept, whichever decode answers last (the
//     reference keeps the last answer);
//   - GET /v1/models is forwarded to a decode instance, and both health
//     endpoints and /metrics are served in both modes.
//
// Request-path cost: the prefill and decode requests go through a lean
// HTTP/1.1 client (upstream.go: pooled keep-alive connections, the request
// written and the response read on the handler's goroutine; its reuse and
// retry rules are documented there), and JSON bodies are parsed by a
// top-level scan that keeps encoding/json's acceptance and errors (body.go,
// valid.go). Config.Transport puts net/http's client back (tests).
//
// Imports: the standard library (net/http, net/http/httputil, encoding/json,
// syscall for the idle-connection check), client_golang and zap. It imports
// none of gonixl's engine packages (nixl, shim, sidechannel, capi): the proxy
// only moves JSON between HTTP servers.
//
// Concurrency: a *Proxy is safe for concurrent use by any number of requests
// (it is an http.Handler). Round-robin counters are atomic; the in-process
// conversation cache is guarded by a mutex and reads time only through
// Config.Clock, so tests drive expiry without sleeping; a shared store keeps
// its own atomicity (one server-side script per call). The package starts no goroutines of its own
// beyond those net/http starts per connection and the idle-connection sweep
// timer of each upstream pool (time.AfterFunc, armed while idle connections
// exist), and never calls os.Exit or installs signal handlers.
package proxy
