package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// TestHAStandbyUnderBursts: two instances on one slot while the active one
// stores far more than the in-flight window (1,024 events) between two of
// the standby's retries: transactions of 2,500 rows. The standby never
// exits; it took 1,041 messages after its last retry for foreign ones (exit
// 1, "more than it had in flight"). Then the takeovers:
//
//   - A streams (through a proxy), B stands by under bursts;
//   - A's network goes dark, B takes over and stores bursts while A,
//     reconnected, stands by: A remembers its own acks from before B's;
//   - B is SIGKILLed right after a burst's commit: A takes over again, past
//     everything B stored since A last streamed.
//
// Every row once, in commit order, in exactly-once and atomic mode.
func TestHAStandbyUnderBursts(t *testing.T) {
	runsBeside(t)
	for _, mode := range []struct{ name, env string }{
		{"exactly-once", ""},
		{"atomic", atomicTx},
	} {
		t.Run(mode.name, func(t *testing.T) {
			testHAStandbyUnderBursts(t, mode.env)
		})
	}
}

func testHAStandbyUnderBursts(t *testing.T, modeEnv string) {
	const burst, bursts = 2500, 3
	f := newFixture(t, withPG(testenv.WithSetting("wal_sender_timeout", "5s")))
	f.env = append(f.env, exactlyOnce, "JETBOX_LOG_LEVEL=info", "JETBOX_POSTGRES_TIMEOUT=5s")
	if modeEnv != "" {
		f.env = append(f.env, modeEnv)
	}
	o := f.newOracle()
	conn := f.conn()
	proxy := testenv.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", f.pg.Port()))
	direct := f.pgURL
	addrA, addrB := httpAddr(t), httpAddr(t)
	f.pgURL = fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", proxy.Addr)
	a := f.start("JETBOX_HTTP_ADDR=" + addrA)
	f.waitStreaming(a)
	f.pgURL = direct
	b := f.start("JETBOX_HTTP_ADDR=" + addrB)

	// running fails the test if p exited (nothing here stops them).
	running := func(p *proc, name string) {
		t.Helper()
		select {
		case <-p.done:
			t.Fatalf("instance %s exited with %d on its own:\n%s", name, p.code, p.tail(4096))
		default:
		}
	}
	waitState := func(p *proc, name, addr, want string) {
		t.Helper()
		testenv.WaitFor(t, time.Minute, func() error {
			running(p, name)
			if _, r := getReady(t, addr); r.State != want {
				return fmt.Errorf("%s state %q, want %q", name, r.State, want)
			}
			return nil
		})
	}
	// retried waits until the standby was refused the slot again (the
	// server logs each refused START_REPLICATION): it retried after what
	// the stream holds now.
	retried := func(standby *proc, name string) {
		t.Helper()
		n := strings.Count(f.pg.Log(), `replication slot "jetbox" is active for PID`)
		testenv.WaitFor(t, time.Minute, func() error {
			running(standby, name)
			if strings.Count(f.pg.Log(), `replication slot "jetbox" is active for PID`) == n {
				return fmt.Errorf("%s not refused the slot since", name)
			}
			return nil
		})
	}
	var want []string
	burstsStored := func(standby *proc, name string) {
		t.Helper()
		for i := 0; i < bursts; i++ {
			want = append(want, f.insertTx(conn, fmt.Sprintf("%s-%d", name, i), burst)...)
			f.waitCount(len(want), 2*time.Minute)
			retried(standby, name)
		}
	}

	// A streams, B stands by while A stores bursts.
	waitState(b, "B", addrB, "standby")
	want = append(want, f.insertTx(conn, "first", 1)...)
	f.waitCount(len(want), time.Minute)
	retried(b, "B")
	burstsStored(b, "B")
	waitState(b, "B", addrB, "standby")
	running(a, "A")

	// A's network goes dark: B takes over once the walsender's timeout
	// frees the slot; A, back, stands by while B stores bursts.
	proxy.Pause()
	waitState(b, "B", addrB, "streaming")
	proxy.Resume()
	waitState(a, "A", addrA, "standby")
	burstsStored(a, "A")
	waitState(a, "A", addrA, "standby")

	// B killed right after a burst's commit: A takes over.
	want = append(want, f.insertTx(conn, "last", burst)...)
	b.kill()
	waitState(a, "A", addrA, "streaming")
	want = append(want, f.insertTx(conn, "after", 10)...)
	f.waitCount(len(want), 2*time.Minute)
	running(a, "A")
	f.assertStream(o.ids())
	if got := o.ids(); len(got) != len(want) {
		t.Fatalf("the oracle saw %d rows, the test committed %d", len(got), len(want))
	}
	if code := a.stop(); code != 0 {
		t.Fatalf("A exited with %d on SIGTERM", code)
	}
}
