package cabi

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

var libPath string

// TestMain uses GONIXL_LIB_PATH when set (./build.sh test sets it) and
// otherwise builds the library from ../../capi into a temporary directory.
func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	libPath = os.Getenv("GONIXL_LIB_PATH")
	if libPath == "" {
		dir, err := os.MkdirTemp("", "gonixl-cabi")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		_, file, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(file), "..", "..")
		libPath = filepath.Join(dir, "libgonixl.so")
		cmd := exec.Command("go", "build", "-buildmode=c-shared", "-o", libPath, "./capi")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "building libgonixl.so: %v\n%s", err, out)
			return 1
		}
	}
	return m.Run()
}

var (
	once   sync.Once
	shared *Lib
	oerr   error
)

func lib(t *testing.T) *Lib {
	t.Helper()
	once.Do(func() { shared, oerr = Open(libPath) })
	if oerr != nil {
		t.Fatal(oerr)
	}
	return shared
}

func config(role, kvRole string) []byte {
	b, _ := json.Marshal(map[string]any{"role": role, "kv_role": kvRole, "engine_id": "e1"})
	return b
}

func TestABIVersion(t *testing.T) {
	if got := lib(t).ABIVersion(); got != ABIVersion {
		t.Fatalf("gonixl_abi_version() = %d, header says %d", got, ABIVersion)
	}
}

func TestSizeNegotiation(t *testing.T) {
	l := lib(t)
	_, need, r := l.Bytes("gonixl_version", -1)
	if r.Status != ErrTooSmall || r.Code != ErrTooSmall || need == 0 {
		t.Fatalf("NULL buffer: status %d code %d need %d, want BUFFER_TOO_SMALL and a size", r.Status, r.Code, need)
	}
	if need > 1 {
		_, need2, r := l.Bytes("gonixl_version", 1)
		if r.Status != ErrTooSmall || need2 != need || !strings.Contains(r.Msg, "too small") {
			t.Fatalf("1-byte buffer: %+v need %d", r, need2)
		}
	}
	out, n, r := l.Bytes("gonixl_version", need)
	if r.Status != OK || n != need || len(out) != need {
		t.Fatalf("exact buffer: %+v n=%d", r, n)
	}
	if r := l.BytesNullLen("gonixl_version"); r.Status != ErrNullPointer {
		t.Fatalf("NULL len: %+v", r)
	}
	probe, _, r := l.Bytes("gonixl_probe", 1<<16)
	if r.Status != OK {
		t.Fatalf("probe: %+v", r)
	}
	var rep struct {
		Version string `json:"version"`
		Engines []any  `json:"engines"`
	}
	if err := json.Unmarshal(probe, &rep); err != nil || rep.Version != string(out) {
		t.Fatalf("probe JSON %q: %v", probe, err)
	}
}

func TestHandles(t *testing.T) {
	l := lib(t)
	s, r := l.New("gonixl_scheduler_new", config("scheduler", "kv_producer"), false, false)
	if r.Status != OK || s == 0 {
		t.Fatalf("scheduler_new: %+v handle %#x", r, s)
	}
	w, r := l.New("gonixl_worker_new", config("worker", "kv_consumer"), false, false)
	if r.Status != OK || w == 0 || w == s {
		t.Fatalf("worker_new: %+v handle %#x", r, w)
	}
	if r := l.Close("gonixl_worker_close", s); r.Status != ErrWrongHandle || !strings.Contains(r.Msg, "expected a worker handle") {
		t.Errorf("worker_close(scheduler handle): %+v", r)
	}
	if r := l.Close("gonixl_scheduler_close", w); r.Status != ErrWrongHandle {
		t.Errorf("scheduler_close(worker handle): %+v", r)
	}
	if r := l.Close("gonixl_scheduler_close", s); r.Status != OK {
		t.Errorf("scheduler_close: %+v", r)
	}
	if r := l.Close("gonixl_scheduler_close", s); r.Status != ErrInvalid || !strings.Contains(r.Msg, "already closed") {
		t.Errorf("second close: %+v", r)
	}
	if st := l.CloseNilErr("gonixl_worker_close", w); st != OK {
		t.Errorf("worker_close with NULL err: %d", st)
	}
	for _, h := range []uint64{0, 1, 3, 1 << 20, ^uint64(0)} {
		if r := l.Close("gonixl_worker_close", h); r.Status != ErrInvalid && r.Status != ErrWrongHandle {
			t.Errorf("worker_close(%#x): %+v", h, r)
		}
	}
}

func TestBadInput(t *testing.T) {
	l := lib(t)
	cases := []struct {
		name             string
		cfg              []byte
		nullCfg, nullOut bool
		want             int32
		msg              string
	}{
		{"null config", []byte("{}"), true, false, ErrNullPointer, "NULL"},
		{"null out", config("scheduler", "kv_producer"), false, true, ErrNullPointer, "out handle"},
		{"garbage", []byte("\x00\xff{{"), false, false, ErrInvalidArg, "invalid JSON"},
		{"wrong role", config("worker", "kv_producer"), false, false, ErrInvalidArg, "role"},
		{"bad kv_role", config("scheduler", "both"), false, false, ErrInvalidArg, "kv_role"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h, r := l.New("gonixl_scheduler_new", c.cfg, c.nullCfg, c.nullOut)
			if r.Status != c.want || h != 0 || !strings.Contains(r.Msg, c.msg) || !strings.HasPrefix(r.Msg, "[gonixl] ") {
				t.Fatalf("got %+v handle %#x, want status %d with %q", r, h, c.want, c.msg)
			}
		})
	}
}

func TestConcurrentCalls(t *testing.T) {
	l := lib(t)
	var wg sync.WaitGroup
	errs := make(chan string, 64)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				h, r := l.New("gonixl_worker_new", config("worker", "kv_consumer"), false, false)
				if r.Status != OK {
					errs <- r.Msg
					return
				}
				if r := l.Close("gonixl_worker_close", h); r.Status != OK {
					errs <- r.Msg
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// TestPanicPoisons runs in a child process (the poison is process-wide).
func TestPanicPoisons(t *testing.T) {
	if os.Getenv("GONIXL_CABI_CHILD") == "1" {
		l := lib(t)
		r := l.DebugPanic()
		if r.Status != ErrInternal || !strings.Contains(r.Msg, "Go panic") {
			t.Fatalf("debug_panic: %+v", r)
		}
		_, _, r = l.Bytes("gonixl_version", 64)
		if r.Status != ErrPoisoned {
			t.Fatalf("after panic: %+v, want POISONED", r)
		}
		fmt.Println("CHILD-OK")
		return
	}
	if r := lib(t).DebugPanic(); r.Status != ErrNotSupp {
		t.Fatalf("debug_panic without hook: %+v", r)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPanicPoisons$", "-test.count=1")
	cmd.Env = append(os.Environ(), "GONIXL_CABI_CHILD=1", "GONIXL_TEST_HOOKS=1", "GONIXL_LIB_PATH="+libPath)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "CHILD-OK") {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "library poisoned") {
		t.Errorf("child stderr lacks the panic report:\n%s", out)
	}
}
