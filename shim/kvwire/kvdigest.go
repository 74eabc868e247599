package kvwire

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// KeyKVDigest: the digests of the KV a gonixl prefill computed for the
// blocks its kv_transfer_params name (a KVDigest); a gonixl decode checks
// the blocks it read against them before it reports the request received.
const KeyKVDigest = "gonixl_kv_digest"

// KVDigestAlg is the only hash KVDigest names today (nixl/memhash).
const KVDigestAlg = "xxh3-64"

// maxDigestEntries bounds a decoded KVDigest: a 1M-token prompt of block
// size 16 in 4 groups is 256k blocks.
const maxDigestEntries = 1 << 20

// KVDigest is the value of KeyKVDigest. Block j of group g is block
// remote_block_ids[g][j] of the same params; it holds the KV of prompt
// positions (First[g]+j)*block_size up to Tokens (the last block of the
// prompt is partly filled: only its first Tokens%block_size token slots
// are covered). Digest 0 means "not digested" (not checked).
type KVDigest struct {
	Alg    string  `json:"alg" msgpack:"alg"`
	Tokens int64   `json:"tokens" msgpack:"tokens"`
	First  []int64 `json:"first" msgpack:"first"`
	// Ranks holds one entry per tp rank of the engine that digested, in
	// rank order: each rank digests the blocks as it holds them (its KV
	// heads).
	Ranks []RankDigest `json:"ranks" msgpack:"ranks"`
}

// RankDigest is one rank's digests, per KV-cache group: Blocks[g][j] of
// block j (over every region that holds the group, in region order), and
// Regions[g][r] the wrapping sum, over the group's blocks, of region r's
// per-block hash (r indexes the regions that hold group g, in order). A
// reader that read every block of a group locates a mismatch's layer by
// comparing Regions.
type RankDigest struct {
	Blocks  [][]uint64 `json:"-" msgpack:"blocks"`
	Regions [][]uint64 `json:"-" msgpack:"regions"`
}

// rankDigestJSON is RankDigest in kv_transfer_params: each array as base64
// of little-endian uint64s (a JSON number list would be three times larger,
// and JSON numbers past 2^53 are not exact in every client).
type rankDigestJSON struct {
	Blocks  []string `json:"blocks"`
	Regions []string `json:"regions"`
}

func packU64(v []uint64) string {
	b := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(b[8*i:], x)
	}
	return base64.StdEncoding.EncodeToString(b)
}

func unpackU64(s string, budget *int) ([]uint64, error) {
	if base64.StdEncoding.DecodedLen(len(s)) > 8**budget+8 {
		return nil, fmt.Errorf("more than %d digests", maxDigestEntries)
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, err
	}
	if len(b)%8 != 0 {
		return nil, fmt.Errorf("%d bytes is not a list of 64-bit digests", len(b))
	}
	out := make([]uint64, len(b)/8)
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	*budget -= len(out)
	return out, nil
}

// MarshalJSON writes RankDigest in its base64 form.
func (r RankDigest) MarshalJSON() ([]byte, error) {
	j := rankDigestJSON{Blocks: make([]string, len(r.Blocks)), Regions: make([]string, len(r.Regions))}
	for g, v := range r.Blocks {
		j.Blocks[g] = packU64(v)
	}
	for g, v := range r.Regions {
		j.Regions[g] = packU64(v)
	}
	return json.Marshal(j)
}

// kvDigestJSON is KeyKVDigest's value as it is written.
type kvDigestJSON struct {
	Alg    string           `json:"alg"`
	Tokens int64            `json:"tokens"`
	First  []int64          `json:"first"`
	Ranks  []rankDigestJSON `json:"ranks"`
}

// ParseKVDigest decodes KeyKVDigest's value and checks its shape against
// the params' block lists (one entry per group, one digest per block).
func ParseKVDigest(data json.RawMessage, blocks BlockIDs) (*KVDigest, error) {
	return parseKVDigest(data, blocks, true)
}

func parseKVDigest(data json.RawMessage, blocks BlockIDs, scan bool) (*KVDigest, error) {
	var raw kvDigestJSON
	scanned := scan && plainKVDigest(data, &raw)
	if !scanned {
		raw = kvDigestJSON{}
		if err := json.Unmarshal(data, &raw); err != nil {
			return nil, fmt.Errorf("%s: %w", KeyKVDigest, err)
		}
	}
	if raw.Alg != KVDigestAlg {
		return nil, fmt.Errorf("%s: hash %q is not %q", KeyKVDigest, raw.Alg, KVDigestAlg)
	}
	if raw.Tokens < 0 || len(raw.First) != len(blocks) || len(raw.Ranks) == 0 || len(raw.Ranks) > 1<<16 {
		return nil, fmt.Errorf("%s: %d tokens, %d group offsets and %d ranks for %d groups of blocks", KeyKVDigest, raw.Tokens, len(raw.First), len(raw.Ranks), len(blocks))
	}
	for _, f := range raw.First {
		if f < 0 || f > maxDigestEntries {
			return nil, fmt.Errorf("%s: group offset %d", KeyKVDigest, f)
		}
	}
	d := &KVDigest{Alg: raw.Alg, Tokens: raw.Tokens, First: raw.First, Ranks: make([]RankDigest, len(raw.Ranks))}
	budget := maxDigestEntries
	for i, r := range raw.Ranks {
		if len(r.Blocks) != len(blocks) || len(r.Regions) != len(blocks) {
			return nil, fmt.Errorf("%s: rank %d has %d block lists and %d region lists for %d groups", KeyKVDigest, i, len(r.Blocks), len(r.Regions), len(blocks))
		}
		rd := RankDigest{Blocks: make([][]uint64, len(blocks)), Regions: make([][]uint64, len(blocks))}
		for g := range blocks {
			var err error
			if rd.Blocks[g], err = unpackU64(r.Blocks[g], &budget); err != nil {
				return nil, fmt.Errorf("%s: rank %d group %d blocks: %w", KeyKVDigest, i, g, err)
			}
			if len(rd.Blocks[g]) != len(blocks[g]) {
				return nil, fmt.Errorf("%s: rank %d group %d: %d digests for %d blocks", KeyKVDigest, i, g, len(rd.Blocks[g]), len(blocks[g]))
			}
			if rd.Regions[g], err = unpackU64(r.Regions[g], &budget); err != nil {
				return nil, fmt.Errorf("%s: rank %d group %d regions: %w", KeyKVDigest, i, g, err)
			}
		}
		d.Ranks[i] = rd
	}
	return d, nil
}

// plainKVDigest reads v into raw when it is in the form this package
// writes: the four keys in lower case, each at most once, nothing else.
// Other spellings (encoding/json matches struct keys without regard to
// case, and ignores unknown ones) are left to encoding/json.
func plainKVDigest(v []byte, raw *kvDigestJSON) bool {
	fields, ok := scanObject(v)
	if !ok {
		return false
	}
	for _, f := range fields {
		switch string(f.key) {
		case "alg":
			raw.Alg, ok = plainStringValue(f.val)
		case "tokens":
			raw.Tokens, ok = plainInt(f.val)
		case "first":
			raw.First, ok = plainIDList(f.val)
		case "ranks":
			var ranks [][]rawField
			if ranks, ok = plainObjects(f.val); ok {
				raw.Ranks = make([]rankDigestJSON, len(ranks))
				for i, r := range ranks {
					if ok = plainRankDigest(r, &raw.Ranks[i]); !ok {
						break
					}
				}
			}
		default:
			return false
		}
		if !ok {
			return false
		}
	}
	return true
}

func plainRankDigest(fields []rawField, r *rankDigestJSON) bool {
	ok := true
	for _, f := range fields {
		switch string(f.key) {
		case "blocks":
			r.Blocks, ok = plainStrings(f.val)
		case "regions":
			r.Regions, ok = plainStrings(f.val)
		default:
			return false
		}
		if !ok {
			return false
		}
	}
	return true
}

// PushDigest is what follows PushDigestPrefix: a prefill rank's digests of
// the blocks its WRITE carries into the decode's registered blocks. Block j
// of group g is the decode's registered block j (the WRITE fills the
// registration's blocks in order), holding prompt positions
// (First[g]+j)*block_size up to Tokens; Blocks[g][j] as in RankDigest (0:
// not digested), Source[g][j] the prefill's block id (for logs).
type PushDigest struct {
	RequestID string     `msgpack:"request_id"` // the decode's request id
	Tokens    int64      `msgpack:"tokens"`
	First     []int64    `msgpack:"first"`
	Blocks    [][]uint64 `msgpack:"blocks"`
	Source    BlockIDs   `msgpack:"source"`
}

// EncodePushDigest writes the notification, prefix included.
func EncodePushDigest(d *PushDigest) ([]byte, error) {
	b, err := msgpack.Marshal(d)
	if err != nil {
		return nil, err
	}
	return append([]byte(PushDigestPrefix), b...), nil
}

// DecodePushDigest parses a PushDigest (without its prefix) and checks its
// shape: one offset and one source list per group, a digest per source block.
func DecodePushDigest(b []byte) (*PushDigest, error) {
	if len(b) > MaxPushRegBytes {
		return nil, fmt.Errorf("push digest of %d bytes (limit %d)", len(b), MaxPushRegBytes)
	}
	if err := CheckMsgpack(b, 8); err != nil {
		return nil, err
	}
	d := &PushDigest{}
	if err := msgpack.Unmarshal(b, d); err != nil {
		return nil, fmt.Errorf("push digest: %w", err)
	}
	if d.RequestID == "" || d.Tokens < 0 || len(d.First) != len(d.Blocks) || len(d.Source) != len(d.Blocks) {
		return nil, fmt.Errorf("push digest: request %q, %d tokens, %d offsets, %d digest lists and %d source lists", d.RequestID, d.Tokens, len(d.First), len(d.Blocks), len(d.Source))
	}
	for g := range d.Blocks {
		if len(d.Blocks[g]) != len(d.Source[g]) || d.First[g] < 0 {
			return nil, fmt.Errorf("push digest: group %d: %d digests for %d blocks from position %d", g, len(d.Blocks[g]), len(d.Source[g]), d.First[g])
		}
	}
	return d, nil
}
