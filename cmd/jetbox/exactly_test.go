package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
)

const exactlyOnce = "JETBOX_DELIVERY=exactly-once"

// TestExactlyOnceBeyondDuplicateWindow: a one-second duplicate window, a
// load, and Postgres crashed (no checkpoint: the slot rewinds and replays
// events whose originals are older than the window). In dedup mode those
// replays are stored again; in exactly-once mode the stream still holds every
// row once, in commit order.
func TestExactlyOnceBeyondDuplicateWindow(t *testing.T) {
	for _, mode := range []string{"exactly-once", "dedup"} {
		t.Run(mode, func(t *testing.T) {
			f, o, p, l := underLoad(t, 2, "JETBOX_DUPLICATE_WINDOW=1s", "JETBOX_DELIVERY="+mode)
			var count uint64
			rewound := false
			for i := 0; i < 3 && !rewound; i++ {
				count = f.progress(count, time.Minute)
				// Let jetbox confirm well past the slot's persisted position.
				target := f.currentLSN(f.conn())
				var before pglogrepl.LSN
				testenv.WaitFor(t, time.Minute, func() (err error) {
					if before, _, err = f.slotState(); err == nil && before < target {
						err = fmt.Errorf("confirmed %s, waiting for %s", before, target)
					}
					return err
				})
				p.kill()
				f.pg.Stop("immediate")
				time.Sleep(1500 * time.Millisecond) // let the duplicate window pass: this is the hazard under test
				f.pg.Start()
				after, _, err := f.slotState()
				must(t, err)
				rewound = after < before
				t.Logf("crash %d: slot confirmed %s before, %s after recovery", i+1, before, after)
				p = f.start()
				f.waitStreaming(p)
			}
			if !rewound {
				t.Skip("Postgres persisted the slot at every crash: no replay to test")
			}
			l.stop()
			want := o.ids()
			got := testenv.ReadStream(t, f.js, "OUTBOX", false)
			if mode == "dedup" {
				// Wait for the replay to finish, then show the copies it stored.
				f.waitAtLeast(len(want), time.Minute)
				got = testenv.ReadStream(t, f.js, "OUTBOX", false)
				t.Logf("dedup mode with a 1s window: %d messages for %d rows (%d copies)", len(got), len(want), len(got)-len(want))
				if len(got) <= len(want) {
					t.Fatal("the replay stored no copies in dedup mode: the scenario did not reach past the window")
				}
				// The README's per-mode claim: here the position goes back.
				if n := positionBacksteps(t, testenv.ReadStream(t, f.js, "OUTBOX", true)); n == 0 {
					t.Fatal("dedup mode stored copies, yet Jetbox-Commit-LSN + Jetbox-Tx-Index never went back")
				} else {
					t.Logf("dedup mode: the position went back at %d messages", n)
				}
				return
			}
			f.waitCount(len(want), 2*time.Minute)
			got = f.assertStream(want)
			if n := positionBacksteps(t, testenv.ReadStream(t, f.js, "OUTBOX", true)); n != 0 {
				t.Fatalf("exactly-once: Jetbox-Commit-LSN + Jetbox-Tx-Index went back at %d messages", n)
			}
			t.Logf("exactly-once: %d rows, %d messages, each once in commit order, positions strictly increasing", len(want), len(got))
			p.stop()
		})
	}
}

// positionBacksteps counts the messages whose Jetbox-Commit-LSN +
// Jetbox-Tx-Index is not after the highest seen before them.
func positionBacksteps(t *testing.T, msgs []testenv.StreamMsg) int {
	t.Helper()
	var maxLSN pglogrepl.LSN
	maxIdx, n := -1, 0
	for _, m := range msgs {
		lsn, err := pglogrepl.ParseLSN(m.Header.Get("Jetbox-Commit-LSN"))
		must(t, err)
		var idx int
		_, err = fmt.Sscan(m.Header.Get("Jetbox-Tx-Index"), &idx)
		must(t, err)
		if lsn < maxLSN || (lsn == maxLSN && idx <= maxIdx) {
			n++
			continue
		}
		maxLSN, maxIdx = lsn, idx
	}
	return n
}

// waitAtLeast waits until the stream holds n messages or more.
func (f *fixture) waitAtLeast(n int, timeout time.Duration) {
	f.t.Helper()
	testenv.WaitFor(f.t, timeout, func() error {
		got, err := testenv.StreamCount(f.js, "OUTBOX")
		if err != nil || got < uint64(n) {
			return fmt.Errorf("stream holds %d of at least %d (%v)", got, n, err)
		}
		return nil
	})
}

// TestKillLoopExactlyOnce: the SIGKILL loop in exactly-once mode.
func TestKillLoopExactlyOnce(t *testing.T) { killLoop(t, exactlyOnce) }

// TestNATSRestartExactlyOnce: NATS restarts in exactly-once mode.
func TestNATSRestartExactlyOnce(t *testing.T) { natsRestart(t, exactlyOnce) }

// TestExactlyOnceForeignPublisher: someone else publishes into the stream;
// exactly-once mode cannot order against it, so jetbox stops with a clear
// error instead of corrupting the order.
func TestExactlyOnceForeignPublisher(t *testing.T) {
	f := newFixture(t)
	f.env = append(f.env, exactlyOnce)
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	want := f.insertTx(conn, "a", 3)
	f.waitCount(3, 30*time.Second)
	nc, err := nats.Connect(f.nats.URL)
	must(t, err)
	defer nc.Close()
	_, err = f.js.Publish(ctxT(t, 5*time.Second), "outbox.intruder.Hello", []byte("not from jetbox"))
	must(t, err)
	f.insertTx(conn, "b", 2)
	if code := p.wait(time.Minute); code != exitFailure {
		t.Fatalf("exit %d, want %d:\n%s", code, exitFailure, p.tail(3000))
	}
	if log := p.logText(); !strings.Contains(log, "a message jetbox did not write") || !strings.Contains(log, "only writer") {
		t.Fatalf("no clear error:\n%s", p.tail(3000))
	}
	got := testenv.ReadStream(t, f.js, "OUTBOX", false)
	if len(got) != 4 || got[0].ID != want[0] || got[3].ID != "" {
		t.Fatalf("stream changed after the foreign message: %+v", got)
	}
}
