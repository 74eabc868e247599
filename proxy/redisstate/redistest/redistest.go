package redistest

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Server is one redis-server process that a test started.
type Server struct {
	t    testing.TB
	bin  string
	dir  string
	Port int
	cmd  *exec.Cmd
	exit chan struct{}
}

// Binary returns the server binary to run, or an error saying how to get one.
func Binary() (string, error) {
	if b := os.Getenv("GONIXL_REDIS_SERVER"); b != "" {
		return b, nil
	}
	for _, name := range []string{"redis-server", "valkey-server"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("no redis-server or valkey-server binary on PATH: install Debian's redis-server " +
		"(apt-get install -y redis-server; ./build.sh setup does) or set GONIXL_REDIS_SERVER")
}

// Start starts a server for the test and stops it in the test's cleanup.
// It fails the test when no binary is found.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir()}
	var last error
	for attempt := 0; attempt < 5; attempt++ {
		if s.Port, err = freePort(); err != nil {
			t.Fatal(err)
		}
		if last = s.start(); last == nil {
			t.Cleanup(s.Stop)
			return s
		}
	}
	t.Fatalf("redis-server did not start: %v", last)
	return nil
}

// URL is the server's redis:// URL with database db.
func (s *Server) URL(db int) string {
	return "redis://127.0.0.1:" + strconv.Itoa(s.Port) + "/" + strconv.Itoa(db)
}

// Addr is host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.Port) }

func (s *Server) start() error {
	log, err := os.Create(filepath.Join(s.dir, "redis.log"))
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(s.bin, "--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1", "--dir", s.dir,
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	exit := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exit) }()
	s.cmd, s.exit = cmd, exit
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-exit:
			b, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			s.cmd = nil
			return fmt.Errorf("exited: %s", strings.TrimSpace(string(b)))
		default:
		}
		if ping(s.Addr()) == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.Stop()
	return fmt.Errorf("no PONG on %s within 10 s", s.Addr())
}

// Stop kills the server (its data is lost: no persistence). Idempotent.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	if s.cmd.Process.Signal(syscall.SIGCONT) == nil { // a paused server must run to exit
		_ = s.cmd.Process.Kill()
	}
	<-s.exit
	s.cmd = nil
}

// Restart stops the server and starts a fresh one on the same port.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		if err = s.start(); err == nil {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	s.t.Fatalf("redis-server did not restart on port %d: %v", s.Port, err)
}

// Pause stops the server's process (SIGSTOP): it accepts connections
// (the kernel does) but answers nothing, like a server stuck or overloaded.
func (s *Server) Pause() { _ = s.cmd.Process.Signal(syscall.SIGSTOP) }

// Resume undoes Pause.
func (s *Server) Resume() { _ = s.cmd.Process.Signal(syscall.SIGCONT) }

func ping(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "+PONG") {
		return fmt.Errorf("PING answered %q", line)
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
