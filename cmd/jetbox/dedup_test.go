package main

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go/jetstream"
)

const dedupMode = "JETBOX_DELIVERY=dedup"

// consumed counts what the work-queue consumer got, by subject.
type consumed struct {
	n        atomic.Int64
	mu       sync.Mutex
	subjects map[string]int
}

func (c *consumed) Load() int64 { return c.n.Load() }

func (c *consumed) count(subject string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.subjects[subject]
}

// workQueue creates the outbox stream with WorkQueue retention and a
// consumer that acks (so removes) every message; it returns what the
// consumer got.
func (f *fixture) workQueue() *consumed {
	f.t.Helper()
	ctx := ctxT(f.t, time.Minute)
	_, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.>"},
		Retention: jetstream.WorkQueuePolicy, Storage: jetstream.FileStorage, Duplicates: 30 * time.Minute})
	must(f.t, err)
	cons, err := f.js.CreateOrUpdateConsumer(ctx, "OUTBOX", jetstream.ConsumerConfig{Durable: "worker", AckPolicy: jetstream.AckExplicitPolicy})
	must(f.t, err)
	got := &consumed{subjects: map[string]int{}}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		got.mu.Lock()
		got.subjects[m.Subject()]++
		got.mu.Unlock()
		got.n.Add(1)
		_ = m.Ack()
	})
	must(f.t, err)
	f.t.Cleanup(cc.Stop)
	return got
}

// waitConsumed waits until the stream's last sequence is last and every
// message was consumed (removed).
func (f *fixture) waitConsumed(last uint64, timeout time.Duration) {
	f.t.Helper()
	testenv.WaitFor(f.t, timeout, func() error {
		st, err := f.js.Stream(ctxT(f.t, 5*time.Second), "OUTBOX")
		if err != nil {
			return err
		}
		s := st.CachedInfo().State
		if s.LastSeq > last {
			f.t.Fatalf("stream last sequence %d, want %d: a copy was stored", s.LastSeq, last)
		}
		if s.LastSeq != last || s.Msgs != 0 {
			return fmt.Errorf("last seq %d of %d, %d messages not consumed", s.LastSeq, last, s.Msgs)
		}
		return nil
	})
}

// TestDedupReplayDrainsWithoutWatermark: a WorkQueue stream whose consumer
// removes every message, so after a SIGKILL the restarted jetbox finds no
// watermark (the stream's last message is gone) and replays up to 200 rows
// Postgres re-sends (--status-interval=10s: they were not confirmed yet).
// Guarded replays used to drain one per republish attempt (the first comes
// back Duplicate, every later one "wrong last sequence"), with backoff up
// to 30 s: hours for 200. They must drain with no republish at all.
func TestDedupReplayDrainsWithoutWatermark(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	f := newFixture(t)
	consumed := f.workQueue()
	addr := httpAddr(t)
	env := []string{dedupMode, "JETBOX_STATUS_INTERVAL=10s", "JETBOX_HTTP_ADDR=" + addr}
	p := f.start(env...)
	f.waitStreaming(p)
	before, _, err := f.slotState()
	must(t, err)
	conn := f.conn()
	for i := 0; i < 20; i++ {
		f.insertTx(conn, fmt.Sprint("a", i), 10)
	}
	f.waitConsumed(200, time.Minute)
	p.kill()
	at, _, err := f.slotState()
	must(t, err)
	target := f.currentLSN(conn)
	t.Logf("slot confirmed %s before the rows, %s at the kill, WAL at %s", before, at, target)
	if at >= target {
		t.Fatal("every row was confirmed before the kill: no replay to test")
	}

	p = f.start(env...)
	testenv.WaitFor(t, 2*time.Minute, func() error { // the drain, then a status update
		if lsn, _, err := f.slotState(); err != nil || lsn < target {
			return fmt.Errorf("slot confirmed %s, drained at %s (%v)", lsn, target, err)
		}
		return nil
	})
	m := scrape(t, addr)
	attempts := strings.Count(p.logText(), "publish failed: republishing")
	t.Logf("after the restart: %v duplicates, %v published, %v republished events in %d attempts",
		m["jetbox_events_duplicate_total"], m["jetbox_events_published_total"], m["jetbox_publish_retries_total"], attempts)
	if m["jetbox_events_duplicate_total"] == 0 {
		t.Fatal("the restart replayed nothing")
	}
	if attempts > 0 || m["jetbox_publish_retries_total"] > 0 {
		t.Fatalf("the replay needed %d republish attempts (%v events republished), want none", attempts, m["jetbox_publish_retries_total"])
	}
	// New rows after the replay go on, guarded, in order.
	f.insertTx(conn, "after", 5)
	f.waitConsumed(205, time.Minute)
	if n := consumed.Load(); n != 205 {
		t.Fatalf("consumer got %d messages, want 205 (each row once)", n)
	}
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d", code)
	}
}

// TestRepeatedIDAfterOriginalConsumed: on a WorkQueue stream the original
// of a Duplicate PubAck is usually gone (consumed). A row reusing the id
// of a consumed row inside the duplicate window (the row deleted, the id
// inserted again) used to be counted as a replay with a warning: dropped
// silently. It is a duplicate-id: exit 1 under stop, a dead letter under
// dead-letter; never stored as if delivered.
func TestRepeatedIDAfterOriginalConsumed(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	for _, policy := range []string{"stop", "dead-letter"} {
		t.Run(policy, func(t *testing.T) {
			f := newFixture(t)
			got := f.workQueue()
			p := f.start(dedupMode, "JETBOX_ON_INVALID="+policy)
			f.waitStreaming(p)
			const id = "00000000-0000-4000-8000-00000000000a"
			row := `INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ('` + id + `', 'order', 'o-1', 'Created', '{}')`
			f.pg.Exec(t, row)
			f.insertTx(f.conn(), "b", 1)
			f.waitConsumed(2, time.Minute)
			f.pg.Exec(t, "DELETE FROM outbox WHERE id = '"+id+"'")
			f.pg.Exec(t, row) // another row, the same id
			if policy == "stop" {
				p.waitExit(exitFailure, "duplicate-id", "no longer in the stream")
				f.waitConsumed(2, 10*time.Second) // nothing more stored
				return
			}
			f.waitConsumed(3, time.Minute)
			if n := got.count("outbox._dlq.duplicate-id"); n != 1 {
				t.Fatalf("%d dead letters for the repeated id, want 1", n)
			}
			if code := p.stop(); code != 0 {
				t.Fatalf("exit %d", code)
			}
		})
	}
}
