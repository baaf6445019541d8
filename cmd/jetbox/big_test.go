package main

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// TestMillionRowTransaction: one transaction of 1,000,000 outbox rows flows
// through with memory bounded by the publish window, and the slot is
// confirmed only once the whole transaction is acked.
func TestMillionRowTransaction(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	runsBeside(t)
	rows := envInt("JETBOX_BIG_TX_ROWS", 1_000_000)
	f := newFixture(t)
	o := f.newOracle()
	p := f.start("JETBOX_LOG_LEVEL=info")
	f.waitStreaming(p)
	startLSN, _, err := f.slotState()
	must(t, err)

	began := time.Now()
	f.pg.Exec(t, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', 'o-' || g, 'OrderCreated', jsonb_build_object('n', g, 'pad', repeat('x', 64)) FROM generate_series(1, $1) g`, rows)
	inserted := time.Since(began)
	end := o.lastCommitEnd()

	// While the transaction is in flight the slot stays at its old position.
	testenv.WaitFor(t, 10*time.Minute, func() error {
		n, err := testenv.StreamCount(f.js, "OUTBOX")
		if err != nil {
			return err
		}
		lsn, _, err := f.slotState()
		if err != nil {
			return err
		}
		if n < uint64(rows) && lsn >= end {
			t.Fatalf("slot confirmed %s (transaction end %s) with %d of %d rows stored", lsn, end, n, rows)
		}
		if n < uint64(rows) {
			return fmt.Errorf("%d of %d rows stored", n, rows)
		}
		return nil
	})
	forwarded := time.Since(began)
	rss := p.peakRSS()
	testenv.WaitFor(t, time.Minute, func() error {
		lsn, _, err := f.slotState()
		if err != nil {
			return err
		}
		if lsn < end {
			return fmt.Errorf("confirmed %s, transaction ends %s", lsn, end)
		}
		return nil
	})
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", false)
	seen := make(map[string]struct{}, len(msgs))
	for _, m := range msgs {
		if _, dup := seen[m.ID]; dup {
			t.Fatalf("id %s stored twice", m.ID)
		}
		seen[m.ID] = struct{}{}
	}
	if len(seen) != rows {
		t.Fatalf("%d distinct ids stored, want %d", len(seen), rows)
	}
	t.Logf("%d-row transaction: insert %s, insert→all stored %s (%.0f events/s), jetbox peak RSS %.1f MiB (slot %s → %s)",
		rows, inserted.Round(time.Millisecond), forwarded.Round(time.Millisecond), float64(rows)/forwarded.Seconds(),
		float64(rss)/(1<<20), startLSN, end)
	// Buffering the transaction would take well over 1 GiB (a million
	// events); bounded by the window, jetbox peaks at about 60 MiB (most of
	// it the binary and the runtime), and the race detector multiplies that
	// by 2–3.
	limit := uint64(96 << 20)
	if raceEnabled {
		limit = 192 << 20
	}
	if uint64(rss) > limit {
		t.Errorf("peak RSS %.1f MiB (limit %d MiB): memory is not bounded by the window", float64(rss)/(1<<20), limit>>20)
	}
	p.stop()
}

// BenchmarkCatchUp measures a catch-up: jetbox starts with a backlog of rows
// (in transactions of 100) already in the WAL and forwards them all; it
// reports events/s from start-up to the last PubAck and jetbox's peak RSS.
// Run: go test ./cmd/jetbox -run '^$' -bench CatchUp -benchtime 1x
// JETBOX_BENCH_ENV adds jetbox settings, space-separated, e.g.
// "JETBOX_DELIVERY=exactly-once JETBOX_ATOMIC_TRANSACTIONS=true".
// JETBOX_BENCH_CLUSTER=3 runs on a three-node cluster and an R3 stream
// (atomic batches allowed), where the server stages batches in memory.
func BenchmarkCatchUp(b *testing.B) {
	rows := envInt("JETBOX_BENCH_ROWS", 200_000)
	env := append([]string{"JETBOX_LOG_LEVEL=info"}, strings.Fields(os.Getenv("JETBOX_BENCH_ENV"))...)
	cluster := os.Getenv("JETBOX_BENCH_CLUSTER") == "3"
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		var f *fixture
		if cluster {
			f, _ = newClusterFixture(b, true)
		} else {
			f = newFixture(b)
		}
		p := f.start(env...)
		f.waitStreaming(p)
		p.stop()
		f.pg.Exec(b, `DO $$ BEGIN FOR i IN 1..`+fmt.Sprint(rows/100)+` LOOP
			INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
			SELECT 'order', 'o-' || g, 'OrderCreated', jsonb_build_object('n', g, 'pad', repeat('x', 64)) FROM generate_series(1, 100) g;
			COMMIT; END LOOP; END $$`)
		b.StartTimer()
		began := time.Now()
		p = f.start(env...)
		f.waitCount(rows, 10*time.Minute)
		took := time.Since(began)
		b.StopTimer()
		rss := p.peakRSS()
		p.stop()
		b.ReportMetric(float64(rows)/took.Seconds(), "events/s")
		b.ReportMetric(float64(rss)/(1<<20), "peakRSS-MiB")
	}
}
