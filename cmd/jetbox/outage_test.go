package main

import (
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// TestNATSOutageBeyondDuplicateWindow: a one-second duplicate window, a load,
// and NATS down for three seconds while rows keep committing, three times:
// stopped cleanly; crash-like while a 20,000-row transaction streams (jetbox's
// connection blackholed first, then the server stopped and the connection
// cut); and stopped with jetbox SIGKILLed at that moment and started again
// once NATS is back (it replays from the slot, whose confirmed position lags
// the acks by up to a status interval). Everything jetbox republishes after
// an outage is older than the window. In exactly-once mode the stream ends
// with every row once, in commit order. The dedup subtest only logs how many
// copies the same outages stored there (nothing may be lost; "once" is not
// promised beyond the window).
func TestNATSOutageBeyondDuplicateWindow(t *testing.T) {
	runsBeside(t)
	for _, mode := range []string{"exactly-once", "dedup"} {
		t.Run(mode, func(t *testing.T) {
			f := newFixture(t)
			proxy := testenv.StartProxy(t, f.nats.URL[len("nats://"):])
			f.natURL = "nats://" + proxy.Addr
			f.env = append(f.env, "JETBOX_DUPLICATE_WINDOW=1s", "JETBOX_DELIVERY="+mode)
			o := f.newOracle()
			p := f.start()
			f.waitStreaming(p)
			l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
			t.Cleanup(l.stop)

			big := f.conn()
			var count uint64
			for _, outage := range []string{"clean stop", "crash-like", "jetbox killed"} {
				count = f.progress(count, time.Minute)
				if outage == "crash-like" {
					f.insertTx(big, "big", 20_000)
					f.progress(f.progress(0, time.Minute)+2000, time.Minute) // the big transaction is flowing
					proxy.Pause()
				}
				f.nats.Stop()
				proxy.Cut()
				proxy.Resume()
				if outage == "jetbox killed" {
					p.kill()
				}
				before := l.txns.Load()
				time.Sleep(3 * time.Second) // the outage outlasts the 1s window: this is the hazard under test
				during := l.txns.Load() - before
				if during == 0 {
					t.Fatal("no transaction committed while NATS was down")
				}
				t.Logf("outage (%s): %d transactions committed while NATS was down", outage, during)
				f.nats.Start()
				if outage == "jetbox killed" {
					p = f.start()
					f.waitStreaming(p)
				}
			}
			count = f.progress(count, time.Minute)
			if mode == "exactly-once" {
				f.finish(l, o)
				if code := p.stop(); code != 0 {
					t.Fatalf("exit code %d after SIGTERM", code)
				}
				return
			}
			l.stop()
			want := o.ids()
			// The order guard stores in commit order: once the last committed
			// row is stored, every republished copy before it is too.
			testenv.WaitFor(t, 2*time.Minute, func() error {
				if n, err := testenv.StreamCount(f.js, "OUTBOX"); err != nil || n < uint64(len(want)) {
					return testenv.ErrNotYet
				}
				if got := testenv.ReadStream(t, f.js, "OUTBOX", false); got[len(got)-1].ID != want[len(want)-1] {
					return testenv.ErrNotYet
				}
				return nil
			})
			got := testenv.ReadStream(t, f.js, "OUTBOX", false)
			stored := make(map[string]bool, len(got))
			for _, m := range got {
				stored[m.ID] = true
			}
			for _, id := range want {
				if !stored[id] {
					t.Fatalf("id %s missing from the stream", id)
				}
			}
			t.Logf("dedup mode, 1s window, three 3s outages: %d messages for %d rows (%d copies)", len(got), len(want), len(got)-len(want))
			p.stop()
		})
	}
}
