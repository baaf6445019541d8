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
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/pgcluster"
)

// Postgres is one throwaway cluster (see internal/pgcluster).
type Postgres struct {
	t        testing.TB
	c        *pgcluster.Cluster
	settings []string
	// DSN connects as the superuser to database postgres.
	DSN string
}

// PGOption tunes a cluster before it starts.
type PGOption func(*Postgres)

// WithSetting adds a server setting (applied after jetbox's defaults).
func WithSetting(name, value string) PGOption {
	return func(p *Postgres) { p.settings = append(p.settings, name+"="+value) }
}

// SkipIfShort skips an integration test under -short: the fast tier runs
// unit, fake-walsender and fuzz-seed tests only.
func SkipIfShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test with real servers: run without -short")
	}
}

// RequireServers reports whether a missing server must fail the test.
func RequireServers() bool { return os.Getenv("JETBOX_REQUIRE_SERVERS") == "1" }

var (
	templateOnce sync.Once
	templateDir  string
	templateErr  error
)

// StartPostgres starts a cluster for the test; cleanup stops it and removes
// its files. Clusters are copies of one initdb per test binary.
func StartPostgres(t testing.TB, opts ...PGOption) *Postgres {
	t.Helper()
	SkipIfShort(t)
	bin, err := pgcluster.FindBinDir()
	if err != nil {
		if RequireServers() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	templateOnce.Do(func() { templateDir, templateErr = pgcluster.InitTemplate(bin) })
	if templateErr != nil {
		t.Fatal(templateErr)
	}
	p := &Postgres{t: t}
	for _, o := range opts {
		o(p)
	}
	p.c, err = pgcluster.New(pgcluster.Options{BinDir: bin, Port: FreePort(t), Template: templateDir, Settings: p.settings})
	if err != nil {
		t.Fatal(err)
	}
	p.DSN = p.c.DSN
	t.Cleanup(func() {
		_ = p.c.Stop("immediate")
		if t.Failed() {
			t.Logf("postgres log (last 4KiB):\n%s", p.c.LogTail(4096))
		}
		p.c.Remove()
	})
	p.Start()
	return p
}

// Port is the server's TCP port on 127.0.0.1.
func (p *Postgres) Port() int { return p.c.Port }

// Log returns the server log so far.
func (p *Postgres) Log() string { b, _ := os.ReadFile(p.c.LogPath); return string(b) }

// DataDir is the cluster's data directory (pg_hba.conf lives there).
func (p *Postgres) DataDir() string { return p.c.DataDir() }

// Start starts the server (again) on the same port and data, and waits until
// it accepts connections.
func (p *Postgres) Start() {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := p.c.Start(ctx); err != nil {
		p.t.Fatal(err)
	}
}

// Stop stops the server: mode "smart", "fast" or "immediate" (a crash).
func (p *Postgres) Stop(mode string) {
	p.t.Helper()
	if err := p.c.Stop(mode); err != nil {
		p.t.Fatal(err)
	}
}

// Restart stops the server with mode and starts it again.
func (p *Postgres) Restart(mode string) {
	p.t.Helper()
	p.Stop(mode)
	p.Start()
}

// RestartWith stops the server with mode and starts it again with settings
// ("name=value", applied after the others, and kept for later starts).
func (p *Postgres) RestartWith(mode string, settings ...string) {
	p.t.Helper()
	p.Stop(mode)
	p.c.AddSettings(settings...)
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

// handedOut holds every port FreePort returned in this test binary. A
// server a test stops and starts again keeps its port free in between; the
// long fault tests run two at a time, so another test must not be handed
// that port meanwhile (its server would fail to start, or the first test's
// clients would reach it).
var handedOut = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// FreePort returns a TCP port free on 127.0.0.1 at the time of the call and
// never returned before in this test binary.
func FreePort(t testing.TB) int {
	t.Helper()
	handedOut.Lock()
	defer handedOut.Unlock()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if !handedOut.ports[port] {
			handedOut.ports[port] = true
			return port
		}
	}
	t.Fatal("no free port on 127.0.0.1 that was not handed out before, in 100 tries")
	return 0
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
