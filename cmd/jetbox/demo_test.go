package main

import (
	"bytes"
	"context"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/pgcluster"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// syncBuffer is a bytes.Buffer safe to read while a process writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

func requirePG(t *testing.T) {
	testenv.SkipIfShort(t)
	if _, err := pgcluster.FindBinDir(); err != nil {
		if testenv.RequireServers() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

// TestDemo runs `jetbox demo` as a new user would: the sample orders arrive,
// the next steps are printed, Ctrl-C stops it with exit 0 and everything it
// started is gone.
func TestDemo(t *testing.T) {
	requirePG(t)
	var out syncBuffer
	cmd := exec.Command(jetboxBin, "demo", "--orders=3", "--interval=50ms")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	deadline := time.After(2 * time.Minute)
	for !strings.Contains(out.String(), "Running until Ctrl-C") {
		select {
		case err := <-done:
			t.Fatalf("demo exited early (%v):\n%s", err, out.String())
		case <-deadline:
			cmd.Process.Kill()
			t.Fatalf("demo did not get through its sample orders:\n%s", out.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	text := out.String()
	if n := strings.Count(text, "● outbox.order.OrderPlaced"); n != 3 {
		t.Fatalf("%d events shown, want 3:\n%s", n, text)
	}
	for _, want := range []string{"commit→stored", "traceparent:", "Nats-Msg-Id:", "payload: {", "psql ", "nats --server"} {
		if !strings.Contains(text, want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
	dsn := regexp.MustCompile(`postgres://postgres@127\.0\.0\.1:\d+/postgres\?sslmode=disable`).FindString(text)
	_ = cmd.Process.Signal(syscall.SIGINT)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("demo exit after Ctrl-C: %v\n%s", err, out.String())
		}
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		t.Fatal("demo did not stop after Ctrl-C")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, dsn); err == nil {
		conn.Close(ctx)
		t.Fatal("the demo's Postgres still runs after it exited")
	}
}
