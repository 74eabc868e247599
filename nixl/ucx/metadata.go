package ucx

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"

	"github.com/gonixl/gonixl/nixl"
)

// Metadata wire format (little endian), version 3:
//
//	magic    8 bytes  "GXUCXMD\x00"
//	version  u16      1
//	flags    u16      0 (reserved)
//	ucxver   u32      libucp version of the writer: major<<16 | minor<<8 | release
//	name     u16 n, n bytes (1..maxNameLen)
//	address  u32 n, n bytes (the UCP worker address, 1..maxAddrLen)
//	bootid   u8 n, n bytes (/proc/sys/kernel/random/boot_id; 0 when unknown)
//	pidns    u64      inode of /proc/self/ns/pid (0 when unknown)
//	pid      u32      writer's process id
//	start    u64      writer's start time (field 22 of /proc/self/stat)
//	netns    u64      inode of /proc/self/ns/net (0 when unknown; version 3 only)
//	regions  u32 count (0..maxRegions), then per region:
//	           mem u32, addr u64, len u64, devId u64, rkey u16 n, n bytes (1..maxRkeyLen),
//	           shm u8 (version 2 on; 0 or 1, and in version 4 a bit set:
//	           1 shm, 2 cuda), and with shm: fd u32, inode u64,
//	           device u64, token u64, base u64, length u64 (the region's
//	           page-aligned interior that the writer re-backed with a memfd,
//	           see shm.go); then with cuda (version 4, VRAM regions): the
//	           CUDA IPC handle of the allocation holding the region (64
//	           bytes), the allocation's base u64 and size u64 in the writer's
//	           address space, and the device's UUID (16 bytes); the rkey of
//	           such a region may be empty (0 bytes: no UCX registration)
//	crc      u32      CRC-32C of every byte before it
//
// A reader accepts versions 1 (no shm byte), 2 (no netns), 3 and 4 (the
// cuda bit); a writer writes 4 only when a region carries CUDA IPC data, so
// that DRAM-only peers stay readable by builds that know version 3.
// Nothing may follow the checksum. The worker address and rkeys are parsed
// by UCX itself, which trusts their inner lengths; the checksum keeps a
// truncated or corrupted blob from ever reaching it. A reader checks every length against
// what remains before it reads, so a truncated or garbage blob is an error.
const (
	mdMagic    = "GXUCXMD\x00"
	mdVersion  = 4
	mdOldest   = 1    // oldest version this build reads
	maxNameLen = 1024 // also the C side's GX_MAX_NAME
	maxAddrLen = 1 << 20
	maxRegions = 1 << 20
	maxRkeyLen = 1 << 14
)

// metadata is the decoded form of an agent's blob.
type metadata struct {
	UCXVersion uint32
	Name       string
	Address    []byte
	Proc       procID
	Regions    []mdRegion
}

// procID identifies the writing process on its host, so that a peer on the
// same host (same boot and pid namespace) can be checked for liveness.
type procID struct {
	BootID string
	PidNS  uint64
	NetNS  uint64 // 0: unknown (a version-2 writer)
	Pid    uint32
	Start  uint64
}

type mdRegion struct {
	Mem   nixl.MemType
	Addr  uint64
	Len   uint64
	DevID uint64
	Rkey  []byte
	Shm   *mdShm  // nil: not shared
	Cuda  *mdCuda // nil: no CUDA IPC export
}

// mdCuda locates a VRAM region's allocation for CUDA IPC: the handle of the
// allocation, its base and size in the writer's address space, and the
// device it lives on.
type mdCuda struct {
	Handle     [cudaIPCHandleLen]byte
	Base, Size uint64
	UUID       [16]byte
}

const (
	cudaIPCHandleLen = 64
	mdCudaBytes      = cudaIPCHandleLen + 8 + 8 + 16
)

// mdShm locates the memfd behind a region's page-aligned interior
// [Base, Base+Len) in the writer's process.
type mdShm struct {
	Fd        uint32
	Ino, Dev  uint64
	Token     uint64
	Base, Len uint64
}

const mdShmBytes = 4 + 8*5

// Region flags (the byte after the rkey).
const (
	mdFlagShm  = 1
	mdFlagCuda = 2
)

func (m *metadata) encode() ([]byte, error) {
	if len(m.Name) == 0 || len(m.Name) > maxNameLen {
		return nil, fmt.Errorf("agent name length %d outside 1..%d", len(m.Name), maxNameLen)
	}
	if len(m.Address) == 0 || len(m.Address) > maxAddrLen {
		return nil, fmt.Errorf("worker address length %d outside 1..%d", len(m.Address), maxAddrLen)
	}
	if len(m.Regions) > maxRegions {
		return nil, fmt.Errorf("%d regions, more than %d", len(m.Regions), maxRegions)
	}
	if len(m.Proc.BootID) > 255 {
		return nil, fmt.Errorf("boot id of %d bytes", len(m.Proc.BootID))
	}
	version := uint16(3)
	for _, r := range m.Regions {
		if r.Cuda != nil {
			version = 4
		}
	}
	size := 8 + 2 + 2 + 4 + 2 + len(m.Name) + 4 + len(m.Address) + 1 + len(m.Proc.BootID) + 8 + 4 + 8 + 8 + 4 + 4
	for _, r := range m.Regions {
		if (len(r.Rkey) == 0 && r.Cuda == nil) || len(r.Rkey) > maxRkeyLen {
			return nil, fmt.Errorf("rkey length %d outside 1..%d", len(r.Rkey), maxRkeyLen)
		}
		size += 4 + 8 + 8 + 8 + 2 + len(r.Rkey) + 1
		if r.Shm != nil {
			size += mdShmBytes
		}
		if r.Cuda != nil {
			size += mdCudaBytes
		}
	}
	b := make([]byte, 0, size)
	b = append(b, mdMagic...)
	b = binary.LittleEndian.AppendUint16(b, version)
	b = binary.LittleEndian.AppendUint16(b, 0)
	b = binary.LittleEndian.AppendUint32(b, m.UCXVersion)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(m.Name)))
	b = append(b, m.Name...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(m.Address)))
	b = append(b, m.Address...)
	b = append(b, byte(len(m.Proc.BootID)))
	b = append(b, m.Proc.BootID...)
	b = binary.LittleEndian.AppendUint64(b, m.Proc.PidNS)
	b = binary.LittleEndian.AppendUint32(b, m.Proc.Pid)
	b = binary.LittleEndian.AppendUint64(b, m.Proc.Start)
	b = binary.LittleEndian.AppendUint64(b, m.Proc.NetNS)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(m.Regions)))
	for _, r := range m.Regions {
		b = binary.LittleEndian.AppendUint32(b, uint32(r.Mem))
		b = binary.LittleEndian.AppendUint64(b, r.Addr)
		b = binary.LittleEndian.AppendUint64(b, r.Len)
		b = binary.LittleEndian.AppendUint64(b, r.DevID)
		b = binary.LittleEndian.AppendUint16(b, uint16(len(r.Rkey)))
		b = append(b, r.Rkey...)
		var flags byte
		if r.Shm != nil {
			flags |= mdFlagShm
		}
		if r.Cuda != nil {
			flags |= mdFlagCuda
		}
		b = append(b, flags)
		if r.Shm != nil {
			b = binary.LittleEndian.AppendUint32(b, r.Shm.Fd)
			b = binary.LittleEndian.AppendUint64(b, r.Shm.Ino)
			b = binary.LittleEndian.AppendUint64(b, r.Shm.Dev)
			b = binary.LittleEndian.AppendUint64(b, r.Shm.Token)
			b = binary.LittleEndian.AppendUint64(b, r.Shm.Base)
			b = binary.LittleEndian.AppendUint64(b, r.Shm.Len)
		}
		if r.Cuda != nil {
			b = append(b, r.Cuda.Handle[:]...)
			b = binary.LittleEndian.AppendUint64(b, r.Cuda.Base)
			b = binary.LittleEndian.AppendUint64(b, r.Cuda.Size)
			b = append(b, r.Cuda.UUID[:]...)
		}
	}
	b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
	return b, nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// reader consumes a blob front to back; every read checks the remaining
// length first.
type reader struct {
	b   []byte
	off int
	err error
}

func (r *reader) take(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b)-r.off {
		r.err = fmt.Errorf("truncated at byte %d reading %s (%d bytes wanted, %d left)", r.off, what, n, len(r.b)-r.off)
		return nil
	}
	s := r.b[r.off : r.off+n]
	r.off += n
	return s
}

func (r *reader) u16(what string) uint16 {
	if s := r.take(2, what); s != nil {
		return binary.LittleEndian.Uint16(s)
	}
	return 0
}

func (r *reader) u32(what string) uint32 {
	if s := r.take(4, what); s != nil {
		return binary.LittleEndian.Uint32(s)
	}
	return 0
}

func (r *reader) u64(what string) uint64 {
	if s := r.take(8, what); s != nil {
		return binary.LittleEndian.Uint64(s)
	}
	return 0
}

// decodeMetadata parses and validates a blob. The returned slices are copies.
func decodeMetadata(b []byte) (*metadata, error) {
	if len(b) < len(mdMagic) || string(b[:len(mdMagic)]) != mdMagic {
		return nil, fmt.Errorf("not gonixl ucx-engine metadata (bad magic; is the peer using another transfer engine?)")
	}
	if len(b) >= len(mdMagic)+2 {
		if ver := binary.LittleEndian.Uint16(b[len(mdMagic):]); ver < mdOldest || ver > mdVersion {
			return nil, fmt.Errorf("metadata version %d, this build reads versions %d to %d", ver, mdOldest, mdVersion)
		}
	}
	if len(b) < len(mdMagic)+2+4 {
		return nil, fmt.Errorf("metadata truncated (%d bytes)", len(b))
	}
	body := b[:len(b)-4]
	if got, want := crc32.Checksum(body, castagnoli), binary.LittleEndian.Uint32(b[len(b)-4:]); got != want {
		return nil, fmt.Errorf("metadata checksum mismatch (corrupted or truncated blob of %d bytes)", len(b))
	}
	b = body
	r := &reader{b: b}
	r.take(len(mdMagic), "magic")
	version := r.u16("version")
	r.u16("flags")
	m := &metadata{}
	m.UCXVersion = r.u32("ucx version")
	nameLen := int(r.u16("name length"))
	if r.err == nil && (nameLen == 0 || nameLen > maxNameLen) {
		return nil, fmt.Errorf("agent name length %d outside 1..%d", nameLen, maxNameLen)
	}
	m.Name = string(r.take(nameLen, "name"))
	addrLen := r.u32("address length")
	if r.err == nil && (addrLen == 0 || addrLen > maxAddrLen) {
		return nil, fmt.Errorf("worker address length %d outside 1..%d", addrLen, maxAddrLen)
	}
	m.Address = append([]byte(nil), r.take(int(addrLen), "worker address")...)
	if s := r.take(1, "boot id length"); s != nil {
		m.Proc.BootID = string(r.take(int(s[0]), "boot id"))
	}
	m.Proc.PidNS = r.u64("pid namespace")
	m.Proc.Pid = r.u32("pid")
	m.Proc.Start = r.u64("start time")
	if version >= 3 {
		m.Proc.NetNS = r.u64("network namespace")
	}
	n := r.u32("region count")
	if r.err == nil && n > maxRegions {
		return nil, fmt.Errorf("region count %d above %d", n, maxRegions)
	}
	// Each region needs at least 31 bytes: a count that cannot fit is
	// rejected before anything is allocated for it.
	if r.err == nil && uint64(n)*31 > uint64(len(b)-r.off) {
		return nil, fmt.Errorf("region count %d does not fit in the %d bytes left", n, len(b)-r.off)
	}
	if r.err == nil {
		m.Regions = make([]mdRegion, 0, n)
	}
	for i := uint32(0); r.err == nil && i < n; i++ {
		var g mdRegion
		mem := r.u32("region memory type")
		g.Addr = r.u64("region address")
		g.Len = r.u64("region length")
		g.DevID = r.u64("region device id")
		kl := int(r.u16("rkey length"))
		if r.err != nil {
			break
		}
		if mem > math.MaxInt32 || nixl.MemType(mem) > nixl.FILE {
			return nil, fmt.Errorf("region %d: unknown memory type %d", i, mem)
		}
		g.Mem = nixl.MemType(mem)
		if g.Len == 0 || g.Addr+g.Len < g.Addr {
			return nil, fmt.Errorf("region %d: bad range addr=%#x len=%d", i, g.Addr, g.Len)
		}
		if (kl == 0 && version < 4) || kl > maxRkeyLen {
			return nil, fmt.Errorf("region %d: rkey length %d outside 1..%d", i, kl, maxRkeyLen)
		}
		g.Rkey = append([]byte(nil), r.take(kl, "rkey")...)
		if version >= 2 {
			maxFlags := byte(mdFlagShm)
			if version >= 4 {
				maxFlags |= mdFlagCuda
			}
			f := r.take(1, "region flags")
			if f != nil && f[0]&^maxFlags != 0 {
				return nil, fmt.Errorf("region %d: flags %#x", i, f[0])
			}
			if f != nil && f[0]&mdFlagShm != 0 {
				sh := &mdShm{Fd: r.u32("shm fd"), Ino: r.u64("shm inode"), Dev: r.u64("shm device"),
					Token: r.u64("shm token"), Base: r.u64("shm base"), Len: r.u64("shm length")}
				if r.err == nil && (sh.Len == 0 || sh.Base < g.Addr || sh.Base+sh.Len < sh.Base || sh.Base+sh.Len > g.Addr+g.Len) {
					return nil, fmt.Errorf("region %d: shared range %#x+%d outside the region %#x+%d", i, sh.Base, sh.Len, g.Addr, g.Len)
				}
				g.Shm = sh
			}
			if f != nil && f[0]&mdFlagCuda != 0 {
				c := &mdCuda{}
				copy(c.Handle[:], r.take(cudaIPCHandleLen, "cuda ipc handle"))
				c.Base, c.Size = r.u64("cuda allocation base"), r.u64("cuda allocation size")
				copy(c.UUID[:], r.take(16, "cuda device uuid"))
				if r.err == nil && (g.Mem != nixl.VRAM || c.Base > g.Addr || c.Base+c.Size < c.Base || g.Addr+g.Len > c.Base+c.Size) {
					return nil, fmt.Errorf("region %d: CUDA allocation %#x+%d does not hold the %v region %#x+%d", i, c.Base, c.Size, g.Mem, g.Addr, g.Len)
				}
				g.Cuda = c
			}
			if r.err == nil && kl == 0 && g.Cuda == nil {
				return nil, fmt.Errorf("region %d: no rkey and no CUDA IPC handle", i)
			}
		}
		m.Regions = append(m.Regions, g)
	}
	if r.err != nil {
		return nil, r.err
	}
	if r.off != len(b) {
		return nil, fmt.Errorf("%d trailing bytes after the last region", len(b)-r.off)
	}
	return m, nil
}
