// Package testenv starts the real servers jetbox's tests run against: a
// throwaway PostgreSQL cluster (initdb on a temp dir, wal_level=logical, a free
// loopback port, run as an unprivileged user when the tests run as root) and
// an embedded NATS server with JetStream; plus a TCP proxy that cuts or
// blackholes connections.
//
// A missing Postgres binary skips the test, or fails it when
// JETBOX_REQUIRE_SERVERS=1 (CI sets it), so CI can never pass by skipping.
package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Postgres is one throwaway cluster.
type Postgres struct {
	t       testing.TB
	bin     string
	dir     string // parent of the data directory, owned by the server's user
	data    string
	port    int
	args    []string
	cred    *syscall.Credential
	cmd     *exec.Cmd
	exited  chan struct{}
	logPath string
	// DSN connects as the superuser to database postgres.
	DSN string
}

// PGOption tunes a cluster before it starts.
type PGOption func(*Postgres)

// WithSetting adds "-c name=value" to the server's command line.
func WithSetting(name, value string) PGOption {
	return func(p *Postgres) { p.args = append(p.args, "-c", name+"="+value) }
}

// PGBinDir finds the server binaries: $JETBOX_PG_BINDIR, the newest
// /usr/lib/postgresql/*/bin, then PATH. It returns "" when none is found.
func PGBinDir() string {
	if d := os.Getenv("JETBOX_PG_BINDIR"); d != "" {
		return d
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return pgMajor(dirs[i]) > pgMajor(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p)
	}
	return ""
}

func pgMajor(dir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return n
}

// RequireServers reports whether a missing server must fail the test.
func RequireServers() bool { return os.Getenv("JETBOX_REQUIRE_SERVERS") == "1" }

var (
	templateOnce sync.Once
	templateDir  string
	templateErr  error
)

// serverCredential returns the unprivileged user to run Postgres as when the
// tests run as root (initdb and postgres refuse root), or nil.
func serverCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("nobody")
	if err != nil {
		return nil, fmt.Errorf("tests run as root and need an unprivileged user for postgres: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// ownedTempDir makes a directory the server's user can write.
func ownedTempDir(cred *syscall.Credential, pattern string) (string, error) {
	dir, err := os.MkdirTemp("", pattern)
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return "", err
		}
	}
	return dir, nil
}

// template runs initdb once per test binary; clusters are copies of it.
func template(bin string, cred *syscall.Credential) (string, error) {
	templateOnce.Do(func() {
		dir, err := ownedTempDir(cred, "jetbox-pgtemplate-")
		if err != nil {
			templateErr = err
			return
		}
		data := filepath.Join(dir, "data")
		cmd := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8", "--locale=C")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		if out, err := cmd.CombinedOutput(); err != nil {
			templateErr = fmt.Errorf("initdb: %v\n%s", err, out)
			return
		}
		templateDir = data
	})
	return templateDir, templateErr
}

// StartPostgres starts a cluster for the test; cleanup stops it and removes
// its files. Settings needed by jetbox (wal_level=logical and enough senders
// and slots) are always on.
func StartPostgres(t testing.TB, opts ...PGOption) *Postgres {
	t.Helper()
	bin := PGBinDir()
	if bin == "" {
		msg := "PostgreSQL server binaries not found (set JETBOX_PG_BINDIR or install postgresql-15)"
		if RequireServers() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	cred, err := serverCredential()
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := template(bin, cred)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := ownedTempDir(cred, "jetbox-pg-")
	if err != nil {
		t.Fatal(err)
	}
	p := &Postgres{t: t, bin: bin, dir: dir, data: filepath.Join(dir, "data"), port: FreePort(t), cred: cred,
		logPath: filepath.Join(dir, "postgres.log")}
	cp := exec.Command("cp", "-a", tmpl, p.data)
	if out, err := cp.CombinedOutput(); err != nil {
		t.Fatalf("copy template cluster: %v\n%s", err, out)
	}
	for _, o := range opts {
		o(p)
	}
	p.DSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.port)
	t.Cleanup(func() {
		p.Stop("immediate")
		if t.Failed() {
			if b, err := os.ReadFile(p.logPath); err == nil {
				t.Logf("postgres log (last 4KiB):\n%s", tail(b, 4096))
			}
		}
		_ = os.RemoveAll(dir)
	})
	p.Start()
	return p
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// Port is the server's TCP port on 127.0.0.1.
func (p *Postgres) Port() int { return p.port }

// Start starts the server (again) on the same port and data, and waits until
// it accepts connections.
func (p *Postgres) Start() {
	p.t.Helper()
	if p.cmd != nil {
		p.t.Fatal("postgres already running")
	}
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		p.t.Fatal(err)
	}
	args := append([]string{"-D", p.data, "-p", strconv.Itoa(p.port),
		"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
		"-c", "wal_level=logical", "-c", "max_wal_senders=20", "-c", "max_replication_slots=20",
		"-c", "fsync=off", "-c", "max_connections=60", "-c", "log_min_messages=warning",
		"-c", "wal_sender_timeout=30s"}, p.args...)
	cmd := exec.Command(filepath.Join(p.bin, "postgres"), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred, Setpgid: true}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		p.t.Fatalf("start postgres: %v", err)
	}
	p.cmd, p.exited = cmd, make(chan struct{})
	go func(exited chan struct{}) { _ = cmd.Wait(); logf.Close(); close(exited) }(p.exited)
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, p.DSN)
		cancel()
		if err == nil {
			conn.Close(context.Background())
			return
		}
		select {
		case <-p.exited:
			b, _ := os.ReadFile(p.logPath)
			p.cmd = nil
			p.t.Fatalf("postgres exited at start:\n%s", tail(b, 4096))
		default:
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("postgres not ready after 60s: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // polling readiness: there is no event to wait on
	}
}

// Stop stops the server: mode "smart" (SIGTERM), "fast" (SIGINT) or
// "immediate" (SIGQUIT, a crash: no checkpoint, recovery at next start).
func (p *Postgres) Stop(mode string) {
	if p.cmd == nil {
		return
	}
	sig := map[string]syscall.Signal{"smart": syscall.SIGTERM, "fast": syscall.SIGINT, "immediate": syscall.SIGQUIT}[mode]
	if sig == 0 {
		p.t.Fatalf("unknown stop mode %q", mode)
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.exited:
	case <-time.After(60 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
	p.cmd = nil
}

// Restart stops the server with mode and starts it again.
func (p *Postgres) Restart(mode string) {
	p.t.Helper()
	p.Stop(mode)
	p.Start()
}

// Conn opens a connection (closed at cleanup) to the cluster's postgres database.
func (p *Postgres) Conn(t testing.TB) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.DSN)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// Exec runs sql on a fresh connection and fails the test on error.
func (p *Postgres) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.DSN)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("exec %q: %v", abbreviate(sql), err)
	}
}

func abbreviate(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 120 {
		return s[:120] + "..."
	}
	return s
}

// FreePort returns a TCP port free on 127.0.0.1 at the time of the call.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// WaitFor polls cond until it returns nil or timeout passes, then fails the
// test with cond's last error. Use it to await an observable event (a count,
// an LSN), never as a sleep.
func WaitFor(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %v", timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ErrNotYet is a convenience for WaitFor conditions.
var ErrNotYet = errors.New("not yet")
