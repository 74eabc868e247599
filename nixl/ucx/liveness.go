package ucx

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Same-host liveness. With error handling "none" UCX does not notice a
// dead peer: a transfer from a killed process stays in progress forever.
// When the peer runs on this host (same boot id and pid namespace, both in
// its metadata), gonixl checks /proc for its process instead: gone, or its
// pid reused (another start time), means the peer is dead and its transfers
// fail with ERR_REMOTE_DISCONNECT.

// livenessPeriod throttles the /proc look-ups per peer.
const livenessPeriod = 100 * time.Millisecond

var (
	selfOnce sync.Once
	selfProc procID
)

// thisProc describes this process; fields it cannot read stay zero, which
// disables the check in peers.
func thisProc() procID {
	selfOnce.Do(func() {
		b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
		if err != nil {
			return
		}
		ns, err := nsInode("self", "pid")
		if err != nil {
			return
		}
		netns, _ := nsInode("self", "net") // 0 when unknown: never "same network"
		start, err := startTime("self")
		if err != nil {
			return
		}
		selfProc = procID{BootID: strings.TrimSpace(string(b)), PidNS: ns, NetNS: netns, Pid: uint32(os.Getpid()), Start: start}
	})
	return selfProc
}

// nsInode returns the inode of /proc/<pid>/ns/<kind> ("pid", "net").
func nsInode(pid, kind string) (uint64, error) {
	l, err := os.Readlink("/proc/" + pid + "/ns/" + kind)
	if err != nil {
		return 0, err
	}
	// "pid:[4026531836]"
	i, j := strings.IndexByte(l, '['), strings.IndexByte(l, ']')
	if i < 0 || j < i {
		return 0, fmt.Errorf("unexpected %s namespace link %q", kind, l)
	}
	return strconv.ParseUint(l[i+1:j], 10, 64)
}

// startTime returns field 22 of /proc/<pid>/stat (clock ticks since boot).
func startTime(pid string) (uint64, error) {
	s, _, err := statOf(pid)
	return s, err
}

// statOf returns the start time and state (field 3) of /proc/<pid>/stat.
func statOf(pid string) (uint64, string, error) {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0, "", err
	}
	i := bytes.LastIndexByte(b, ')') // the command name may hold spaces
	if i < 0 {
		return 0, "", fmt.Errorf("unexpected /proc/%s/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); field 22 is f[19].
	if len(f) < 20 {
		return 0, "", fmt.Errorf("short /proc/%s/stat", pid)
	}
	s, err := strconv.ParseUint(f[19], 10, 64)
	return s, f[0], err
}

// sameNetwork reports whether p runs in this process's network namespace
// on this host. UCX's shared-memory and cma lanes are chosen by host (boot
// id), but their wake-up signalling does not cross network namespaces (two
// pods on one node): an endpoint to a peer in another namespace must use
// network transports.
func sameNetwork(p procID) bool {
	me := thisProc()
	return sameHost(p) && me.NetNS != 0 && p.NetNS == me.NetNS
}

// sameHost reports whether p can be checked through this host's /proc.
func sameHost(p procID) bool {
	me := thisProc()
	return me.BootID != "" && p.BootID == me.BootID && p.PidNS == me.PidNS && p.Pid != 0 && p.Start != 0
}

// procDead reports whether the process p names has exited.
func procDead(p procID) (bool, string) {
	s, state, err := statOf(strconv.FormatUint(uint64(p.Pid), 10))
	switch {
	case err != nil && os.IsNotExist(err):
		return true, fmt.Sprintf("peer process %d has exited", p.Pid)
	case err != nil:
		return false, ""
	case s != p.Start:
		return true, fmt.Sprintf("peer process %d has exited (pid reused)", p.Pid)
	case state == "Z" || state == "X":
		return true, fmt.Sprintf("peer process %d has exited (zombie)", p.Pid)
	}
	return false, ""
}
