package main

import (
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// envInt reads a tuning knob for the fault loops (bounded by default so CI
// stays short; raise them locally to soak).
func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// finish stops the load, waits until the stream holds every committed row and
// checks: each once, in commit order (from the independent oracle slot).
func (f *fixture) finish(l *load, o *oracle) []string {
	f.t.Helper()
	l.stop()
	want := o.ids()
	if len(want) == 0 {
		f.t.Fatal("the load committed nothing")
	}
	f.waitCount(len(want), 3*time.Minute)
	f.assertStream(want)
	last, _ := l.lastErr.Load().(string)
	f.t.Logf("%d rows in %d transactions committed and stored once each, in commit order (%d write errors during faults, last: %s)",
		len(want), l.txns.Load(), l.errs.Load(), last)
	return want
}

// progress waits until the stream has grown past n messages.
func (f *fixture) progress(n uint64, timeout time.Duration) uint64 {
	f.t.Helper()
	var got uint64
	testenv.WaitFor(f.t, timeout, func() error {
		var err error
		got, err = testenv.StreamCount(f.js, "OUTBOX")
		if err != nil {
			return err
		}
		if got <= n {
			return fmt.Errorf("stream stuck at %d messages", got)
		}
		return nil
	})
	return got
}

// underLoad starts a fixture with an oracle, a streaming jetbox (env added
// to the defaults) and writers committing a transaction of 1-5 rows about
// every 5ms each. Stop the load with f.finish or l.stop.
func underLoad(t *testing.T, writers int, env ...string) (*fixture, *oracle, *proc, *load) {
	f := newFixture(t)
	f.env = append(f.env, env...)
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)
	l := f.startLoad(writers, 5*time.Millisecond, 1_000_000)
	t.Cleanup(l.stop)
	return f, o, p, l
}

// TestKillLoop SIGKILLs jetbox at random moments under a steady load, starts
// it again each time, and checks the stream ends with every row once, in order.
func TestKillLoop(t *testing.T) {
	runsBeside(t)
	killLoop(t)
}

func killLoop(t *testing.T, env ...string) {
	f, o, p, l := underLoad(t, 3, env...)

	kills := envInt("JETBOX_KILL_LOOPS", 25)
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewSource(seed))
	t.Logf("kill loop: %d kills, seed %d", kills, seed)
	var count uint64
	for i := 0; i < kills; i++ {
		count = f.progress(count, time.Minute)                      // it forwarded something since the last start
		time.Sleep(time.Duration(rng.Intn(400)) * time.Millisecond) // a random moment, not synchronisation
		p.kill()
		p = f.start()
	}
	f.finish(l, o)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}
}

// TestPostgresRestart restarts Postgres (fast, then immediate: a crash that
// rewinds the slot to its last checkpoint) under load.
func TestPostgresRestart(t *testing.T) {
	f, o, p, l := underLoad(t, 2)
	var count uint64
	for _, mode := range []string{"fast", "immediate", "immediate", "fast"} {
		count = f.progress(count, time.Minute)
		f.pg.Restart(mode)
		f.waitStreaming(p)
	}
	count = f.progress(count, time.Minute)
	f.finish(l, o)
	p.stop()
}

// TestNATSRestart restarts the NATS server under load.
func TestNATSRestart(t *testing.T) { natsRestart(t) }

func natsRestart(t *testing.T, env ...string) {
	f, o, p, l := underLoad(t, 2, env...)
	var count uint64
	for i := 0; i < 4; i++ {
		count = f.progress(count, time.Minute)
		f.nats.Restart()
	}
	count = f.progress(count, time.Minute)
	f.finish(l, o)
	p.stop()
}

// TestConnectionCuts cuts jetbox's TCP connections to Postgres and to NATS
// (through in-test proxies) under load, and blackholes each for a while.
func TestConnectionCuts(t *testing.T) {
	runsBeside(t)
	f := newFixture(t)
	o := f.newOracle()
	pgProxy := testenv.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", f.pg.Port()))
	natsProxy := testenv.StartProxy(t, f.nats.URL[len("nats://"):])
	f.pgURL = fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", pgProxy.Addr)
	f.natURL = "nats://" + natsProxy.Addr
	p := f.start("JETBOX_STATUS_INTERVAL=200ms", "JETBOX_POSTGRES_TIMEOUT=2s", "JETBOX_PUBLISH_TIMEOUT=2s")
	f.waitStreaming(p)
	l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
	defer l.stop()

	var count uint64
	for i := 0; i < 4; i++ {
		count = f.progress(count, time.Minute)
		pgProxy.Cut()
		count = f.progress(count, time.Minute)
		natsProxy.Cut()
	}
	// Blackhole Postgres: the socket stays open but nothing flows. jetbox must
	// notice by itself (no message within --postgres-timeout) and reconnect.
	count = f.progress(count, time.Minute)
	mark := len(p.logText())
	pgProxy.Pause()
	testenv.WaitFor(t, time.Minute, func() error {
		// Streaming: "no message ... half-open"; if it was reconnecting at
		// that moment: the bounded connect times out.
		if since := p.logText()[mark:]; !strings.Contains(since, "half-open") && !strings.Contains(since, "connect for replication") {
			return fmt.Errorf("jetbox has not noticed the blackholed Postgres connection")
		}
		return nil
	})
	pgProxy.Cut() // the blackholed sockets are dead for good
	pgProxy.Resume()
	count = f.progress(count, time.Minute)
	// Blackhole NATS: acks stop coming; the publish timeout ends the session.
	mark = len(p.logText())
	natsProxy.Pause()
	testenv.WaitFor(t, time.Minute, func() error {
		// A publish times out, or (when the blackhole came while a session
		// opened) the stream lookup does.
		if since := p.logText()[mark:]; !strings.Contains(since, "timeout") && !strings.Contains(since, "deadline exceeded") {
			return fmt.Errorf("jetbox has not noticed the blackholed NATS connection")
		}
		return nil
	})
	natsProxy.Resume()
	count = f.progress(count, time.Minute)
	f.finish(l, o)
	p.stop()
}
