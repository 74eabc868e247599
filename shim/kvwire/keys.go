package kvwire

// gonixl's own keys in kv_transfer_params, beside vLLM's. A stock engine
// ignores keys it does not know; docs/PROTOCOL.md says who sends each, when,
// and what the receiver does (TestProtocolDocumentsEveryConstant keeps the
// two in step). The Python connector (pybridge/gonixl) spells the same
// strings.
const (
	// KeyPromptDigest: "blake2b-128:<hex>" of a prompt's first
	// remote_num_tokens token ids. A gonixl prefill's params carry it (a
	// decode computes the prompt locally when its own prompt differs), and
	// so do a push registration and a push prefill's request.
	KeyPromptDigest = "gonixl_prompt_digest"
	// KeyPromptMismatch: set by a decode on params whose prompt digest did
	// not match (they were dropped; the prompt is computed locally).
	KeyPromptMismatch = "gonixl_prompt_mismatch"
	// KeyExpiryUnix: the Unix time at which a gonixl decode frees the
	// blocks its params name (bidirectional_kv_xfer).
	KeyExpiryUnix = "gonixl_expiry_unix"
	// KeyTokenDigest: a gonixl decode's chained digest of the tokens its
	// blocks hold (pybridge/gonixl/digest.py).
	KeyTokenDigest = "gonixl_token_digest"
	// KeyReadbackTokens: how many leading prompt tokens a prefill may pull
	// back, as its Python connector found from KeyTokenDigest.
	KeyReadbackTokens = "gonixl_readback_tokens"
	// KeyInstance: the random id of the gonixl scheduler process that
	// made the params; the same id is in its handshake metadata
	// (sidechannel.InstanceKey). A reader whose handshake finds another id
	// at that engine id and address (a restart) does not read.
	KeyInstance = "gonixl_instance"
	// KeyKVDigestServed: true on a gonixl decode's params when the digests
	// of the blocks they name are served on its side channel under
	// remote_request_id (sidechannel.KVDigestMsg): the params leave with
	// the request's last output, before its workers hashed the blocks.
	KeyKVDigestServed = "gonixl_kv_digest_served"
)

// OutParams is the kv_transfer_params dict request_finished returns, with
// vLLM's exact keys (and gonixl_expiry_unix on a decode's).
type OutParams struct {
	DoRemotePrefill bool     `json:"do_remote_prefill"`
	DoRemoteDecode  bool     `json:"do_remote_decode"`
	RemoteBlockIDs  BlockIDs `json:"remote_block_ids"`
	RemoteEngineID  string   `json:"remote_engine_id"`
	RemoteRequestID string   `json:"remote_request_id"`
	RemoteHost      string   `json:"remote_host"`
	RemotePort      int      `json:"remote_port"`
	TPSize          int      `json:"tp_size"`
	DCPSize         int      `json:"dcp_size"`
	PPSize          int      `json:"pp_size"`
	RemoteNumTokens int64    `json:"remote_num_tokens"`
	RemoteExpiry    *float64 `json:"remote_blocks_expiry_time"`
	TransferMode    string   `json:"transfer_mode"`
	// ExpiryUnix (gonixl's addition, a decode's params only): the Unix time
	// at which the decode frees the blocks (decoder_kv_blocks_ttl).
	ExpiryUnix *float64 `json:"gonixl_expiry_unix,omitempty"` // KeyExpiryUnix
	Instance   string   `json:"gonixl_instance,omitempty"`    // KeyInstance
	// KVDigestServed (a decode's params only): KeyKVDigestServed.
	KVDigestServed bool `json:"gonixl_kv_digest_served,omitempty"`
}
