package ucx

// op is one UCP operation of a transfer. Its layout is that of the C struct
// gx_iov (checked at compile time in engine.go), so a []op crosses into C as
// one array.
type op struct {
	laddr, raddr, len uint64
	rkey, memh        uint32 // index into the peer's rkeys / the agent's memhs
}

// coalesce merges runs of operations that are adjacent in both local and
// remote memory and use the same local registration and remote key, in
// place, and returns the shortened slice. Order is kept; nothing is merged
// across a gap on either side.
func coalesce(ops []op) []op {
	if len(ops) < 2 {
		return ops
	}
	out := ops[:1]
	for _, o := range ops[1:] {
		last := &out[len(out)-1]
		if o.rkey == last.rkey && o.memh == last.memh &&
			last.laddr+last.len == o.laddr && last.raddr+last.len == o.raddr &&
			last.len+o.len > last.len { // no wrap-around
			last.len += o.len
			continue
		}
		out = append(out, o)
	}
	return out
}
